use super::*;
use crate::analysis::leak::Verdict;
use crate::analysis::oom::OomClass;
use crate::analysis::predict::Risk;
use ndarray::Array2;

/// Three problems, `per` samples each, seeded noise: healthy (high
/// utilisation), fragmentation OOMs, leaking.
fn population(per: usize, seed: u64) -> Vec<Sample> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut noise = |scale: f64| {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((state >> 11) as f64 / (1u64 << 53) as f64 - 0.5) * scale
    };
    let mut out = Vec::new();
    for i in 0..3 * per {
        let g = i % 3;
        let mut f = [0.0; FEATURES.len()];
        for x in f.iter_mut() {
            *x = 0.1 + noise(0.04);
        }
        f[5] = 0.9 + noise(0.04);
        let trouble = match g {
            0 => Trouble { leak: Some(Verdict::NotLeaking), level: Some(Risk::Minimal), ..Trouble::default() },
            1 => {
                f[0] += 0.6;
                f[7] = 1.0;
                f[5] -= 0.4;
                Trouble { oom_class: Some(OomClass::Fragmentation), level: Some(Risk::High), ..Trouble::default() }
            }
            _ => {
                f[9] += 0.6;
                Trouble { leak: Some(Verdict::Leaking), level: Some(Risk::Minimal), ..Trouble::default() }
            }
        };
        let name = ["healthy", "fragmenting", "leak"][g];
        out.push(Sample { trace: format!("{name}-{seed}-{i}"), unit: None, features: f, trouble });
    }
    out
}

fn quick() -> FitOptions {
    FitOptions { seed: 5, hyper: ssae::Hyper::default().short(), ..FitOptions::default() }
}

#[test]
fn classes_are_learned_named_and_applied_to_new_samples() {
    let train = population(20, 1);
    let model = fit(&train, &quick()).unwrap();
    let mut names: Vec<&str> = model.classes.iter().map(|c| c.name.as_str()).collect();
    names.sort_unstable();
    assert_eq!(names, ["fragmentation-bound", "healthy", "leaking"], "{:?}", model.gaps);
    assert!(model.accuracy.ssae > 0.9 && model.accuracy.nearest_centroid > 0.9, "{:?}", model.accuracy);
    assert_eq!(model.network.layer_search.len(), LAYER_GRID.len());
    let leaking = model.class("leaking").unwrap();
    assert!(leaking.direction.starts_with("Leak: 20 of 20"), "{}", leaking.direction);
    // New samples of the same problems get their class.
    let test = population(10, 2);
    let got = model.classify(&test.iter().map(|s| s.features).collect::<Vec<_>>());
    let want = |s: &Sample| {
        ["healthy", "fragmentation-bound", "leaking"]
            [["healthy", "fragmenting", "leak"].iter().position(|p| s.trace.starts_with(p)).unwrap()]
    };
    let right = test.iter().zip(&got).filter(|(s, a)| a.name == want(s)).count();
    assert!(right >= 28, "{right} of 30: {got:?}");
    assert!(got.iter().all(|a| a.model_id == model.model_id && a.confidence <= 1.0));
    assert!(got.iter().all(|a| (a.confidence > 0.0) == (a.name != model::UNCLASSIFIED)), "{got:?}");
    // Deterministic for a seed.
    assert_eq!(fit(&train, &quick()).unwrap(), model);
    // A sample unlike every class is unclassified, with why.
    let mut odd = [0.1; FEATURES.len()];
    odd[2] = 5.0;
    odd[3] = 5.0;
    let a = &model.classify(&[odd])[0];
    assert_eq!(a.name, model::UNCLASSIFIED);
    assert!(a.why.as_deref().unwrap().contains("99th percentile"), "{a:?}");
    assert_eq!((a.confidence, a.direction.as_deref()), (0.0, None));
}

#[test]
fn user_labels_take_precedence_and_a_refit_keeps_the_names() {
    let train = population(20, 1);
    let mut opts = quick();
    // The user calls two of the leaking samples something else.
    for s in train.iter().filter(|s| s.trace.starts_with("leak")).take(2) {
        opts.labels.insert(s.trace.clone(), "under review".into());
    }
    let model = fit(&train, &opts).unwrap();
    assert_eq!(model.user_labelled, 2);
    assert_eq!(model.class("under review").map(|c| c.members), Some(2));
    assert!(model.class("under review").unwrap().direction.starts_with("A class you named: 2 of 2 leak"));

    // Re-fitting on new samples of the same problems keeps the old names,
    // even where the new grouping would name a class otherwise.
    let mut old = fit(&train, &quick()).unwrap();
    let healthy = old.classes.iter().position(|c| c.name == "healthy").unwrap();
    old.classes[healthy].name = "fine".into();
    let again = FitOptions { from: Some(old.clone()), ..quick() };
    let refit = fit(&population(20, 3), &again).unwrap();
    let r = refit.refit.as_ref().unwrap();
    assert_eq!(r.from_model, old.model_id);
    assert!(refit.class("fine").is_some(), "{:?}", refit.classes.iter().map(|c| &c.name).collect::<Vec<_>>());
    assert!(r.appeared.is_empty() && r.vanished.is_empty(), "{r:?}");

    // A class that is gone is said: fit again without the leaking samples.
    let fewer: Vec<Sample> = population(20, 3).into_iter().filter(|s| !s.trace.starts_with("leak")).collect();
    let refit = fit(&fewer, &again).unwrap();
    assert_eq!(refit.refit.unwrap().vanished, vec!["leaking".to_string()]);
}

#[test]
fn a_model_file_is_checked_when_read() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fit(&population(10, 1), &quick()).unwrap();
    let path = tmp.path().join("fleet.classes");
    model.save(&path).unwrap();
    assert_eq!(Model::load(&path).unwrap(), model);
    let text = std::fs::read_to_string(&path).unwrap();
    let err = |text: &str| {
        std::fs::write(&path, text).unwrap();
        format!("{:#}", Model::load(&path).unwrap_err())
    };
    let e = err(&text[..text.len() / 2]);
    assert!(e.contains("fleet.classes") && e.contains("not JSON"), "{e}");
    let e = err(&text.replace("\"version\": 1", "\"version\": 7"));
    assert!(e.contains("version 7") && e.contains("version 1"), "{e}");
    let e = err(&text.replace("\"leak_rate\"", "\"leak_share\""));
    assert!(e.contains("other features"), "{e}");
    let e = err(&text.replacen("\"members\": ", "\"members\": 1", 1));
    assert!(e.contains("edited"), "{e}");
    let e = err(&text.replacen("\"samples\": ", "\"samples\": \"x\", \"y\": ", 1));
    assert!(e.contains("samples"), "{e}");
    let e = err("{\"format\": \"something else\"}");
    assert!(e.contains("not a fragscope class model"), "{e}");
    assert!(format!("{:#}", Model::load(&tmp.path().join("none")).unwrap_err()).contains("cannot read"));
}

#[test]
fn too_few_samples_are_refused() {
    let e = fit(&population(2, 1), &quick()).unwrap_err().to_string();
    assert!(e.contains("6 samples") && e.contains("at least 8"), "{e}");
}

#[test]
fn groups_of_one_name_are_numbered_around_the_users_names() {
    let mut names: Vec<String> =
        ["leaking", "leaking", "healthy", "leaking", "a", "a", "a (1)"].map(String::from).to_vec();
    let by_user = [false, false, false, true, false, false, false];
    number_duplicates(&mut names, &by_user);
    // The user's "leaking" is kept as given; the groups of that name are
    // numbered; "a (1)" is taken, so the two groups "a" skip it.
    assert_eq!(names, ["leaking (1)", "leaking (2)", "healthy", "leaking", "a (2)", "a (3)", "a (1)"]);
    // A class absent from a fold's training rows has no centroid, and is
    // never the nearest.
    let z = Array2::from_shape_vec((2, 1), vec![0.0, 5.0]).unwrap();
    let c = centroids(&z, &[0, 1], 3, &[0, 1]);
    assert_eq!(c[2], None);
    assert_eq!(nearest(&z, &c).iter().map(|n| n.0).collect::<Vec<_>>(), [0, 1]);
}
