use super::*;

/// Runs Python's own pickle writer when python3 is there; None (and a
/// visible note) when it is not.
fn python_pickle(expr: &str, protocol: u8) -> Option<Vec<u8>> {
    let out = std::process::Command::new("python3")
        .args(["-c", &format!("import pickle,sys; sys.stdout.buffer.write(pickle.dumps({expr}, protocol={protocol}))")])
        .output()
        .ok()?;
    if !out.status.success() {
        eprintln!("skipped: python3 could not pickle {expr}");
        return None;
    }
    Some(out.stdout)
}

fn sample_value() -> Value {
    let shared_name = Value::Str(Rc::new("layer".to_string()));
    let frame = Value::Dict(Rc::new(RefCell::new(vec![
        (Value::Str(Rc::new("name".into())), shared_name.clone()),
        (Value::Str(Rc::new("line".into())), Value::Int(12)),
    ])));
    let frames = Value::List(Rc::new(RefCell::new(vec![frame.clone(), frame])));
    let entries: Vec<Value> = (0..2500)
        .map(|i| {
            Value::Dict(Rc::new(RefCell::new(vec![
                (Value::Str(Rc::new("addr".into())), Value::UInt(u64::MAX - i)),
                (Value::Str(Rc::new("size".into())), Value::Int(-(i as i64) * 70_000)),
                (Value::Str(Rc::new("frames".into())), frames.clone()),
            ])))
        })
        .collect();
    Value::Dict(Rc::new(RefCell::new(vec![
        (Value::Str(Rc::new("entries".into())), Value::List(Rc::new(RefCell::new(entries)))),
        (Value::Str(Rc::new("pool".into())), Value::Tuple(Rc::new(vec![Value::Int(0), Value::Int(1 << 40)]))),
        (Value::Str(Rc::new("ok".into())), Value::Bool(true)),
        (Value::Str(Rc::new("none".into())), Value::None),
        (Value::Str(Rc::new("x".into())), Value::Float(0.25)),
        (Value::Str(Rc::new("long".into())), Value::Str(Rc::new("é".repeat(300)))),
    ])))
}

#[test]
fn written_pickles_read_back_and_share_what_was_shared() {
    let mut buf = Vec::new();
    write(&sample_value(), &mut buf).unwrap();
    assert_eq!(&buf[..2], &[0x80, 4]);
    let v = parse(&buf).unwrap();
    let entries = v.get("entries").unwrap().items().unwrap();
    assert_eq!(entries.len(), 2500);
    assert_eq!(entries[7].get("addr").unwrap().as_int(), Some(i128::from(u64::MAX - 7)));
    assert_eq!(entries[7].get("size").unwrap().as_int(), Some(-490_000));
    assert!(entries[0].get("frames").unwrap().same_object(&entries[2499].get("frames").unwrap()));
    assert_eq!(v.get("pool").unwrap().items().unwrap()[1].as_int(), Some(1 << 40));
    assert_eq!(v.get("long").unwrap().as_str().map(|s| s.chars().count()), Some(300));
    // One frame list for 2 500 entries (each would take 40 bytes more).
    assert!(buf.len() < 2500 * 50, "{} bytes", buf.len());
}

#[test]
fn cpython_reads_written_pickles() {
    let mut buf = Vec::new();
    write(&sample_value(), &mut buf).unwrap();
    let dir = std::env::temp_dir().join(format!("fragscope-pickle-{}", std::process::id()));
    std::fs::write(&dir, &buf).unwrap();
    let script = "import pickle,sys; v=pickle.load(open(sys.argv[1],'rb')); e=v['entries']; \
        assert len(e)==2500 and e[7]['addr']==2**64-1-7 and e[7]['size']==-490000; \
        assert e[0]['frames'] is e[2499]['frames'] and e[0]['frames'][0]['name']=='layer'; \
        assert v['pool']==(0,2**40) and v['ok'] is True and v['none'] is None and v['x']==0.25; \
        assert v['long']=='é'*300; print('ok')";
    let out = std::process::Command::new("python3").args(["-c", script]).arg(&dir).output();
    let _ = std::fs::remove_file(&dir);
    match out {
        Ok(o) => assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr)),
        Err(e) => {
            assert!(std::env::var_os("FRAGSCOPE_REQUIRE_PYTHON").is_none(), "python3: {e}");
            eprintln!("skipped: no python3 ({e})");
        }
    }
}

#[test]
fn opcode_by_opcode() {
    // PROTO 2, EMPTY_DICT, MEMOIZE, MARK, keys and values of each kind, SETITEMS, STOP.
    let mut p = vec![0x80, 2, b'}', 0x94, b'('];
    p.extend([0x8c, 1, b'a', b'K', 7]); // "a": 7
    p.extend([0x8c, 1, b'b', b'M', 0x34, 0x12]); // "b": 0x1234
    p.extend([0x8c, 1, b'c', b'J', 0xff, 0xff, 0xff, 0xff]); // "c": -1
    p.extend([0x8c, 1, b'd', b'N']); // "d": None
    p.extend([0x8c, 1, b'e', 0x88]); // "e": True
    p.extend([0x8c, 1, b'f', 0x89]); // "f": False
    p.extend([0x8c, 1, b'g', b'G']);
    p.extend(1.5f64.to_be_bytes()); // "g": 1.5
    p.extend([b'X', 1, 0, 0, 0, b'h', b']', b'K', 1, b'a', b'(', b'K', 2, b'K', 3, b'e']); // "h": [1, 2, 3]
    p.extend([0x8c, 1, b'i', b'K', 1, b'K', 2, 0x86]); // "i": (1, 2)
    p.extend([0x8c, 1, b'j', b')']); // "j": ()
    p.extend([0x8c, 1, b'k', b'(', b'K', 9, b'l']); // "k": [9]
    p.extend([0x8c, 1, b'l', b'(', b'K', 9, b't']); // "l": (9,)
    p.extend([b'u', b'.']);
    let v = parse(&p).unwrap();
    assert_eq!(v.get("a").unwrap().as_int(), Some(7));
    assert_eq!(v.get("b").unwrap().as_int(), Some(0x1234));
    assert_eq!(v.get("c").unwrap().as_int(), Some(-1));
    assert!(matches!(v.get("d"), Some(Value::None)));
    assert!(matches!(v.get("e"), Some(Value::Bool(true))));
    assert!(matches!(v.get("f"), Some(Value::Bool(false))));
    assert!(matches!(v.get("g"), Some(Value::Float(f)) if f == 1.5));
    let h: Vec<i128> = v.get("h").unwrap().items().unwrap().iter().filter_map(Value::as_int).collect();
    assert_eq!(h, vec![1, 2, 3]);
    assert_eq!(v.get("i").unwrap().items().unwrap().len(), 2);
    assert_eq!(v.get("j").unwrap().items().unwrap().len(), 0);
    assert_eq!(v.get("k").unwrap().items().unwrap()[0].as_int(), Some(9));
    assert!(matches!(v.get("l"), Some(Value::Tuple(_))));
}

#[test]
fn long1_up_to_nine_bytes_and_negative() {
    // 2^64 − 5 in 9 bytes (a sign byte of 0); −2 in 1 byte.
    let p = [0x80, 4, 0x8a, 9, 0xfb, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0, b'.'];
    assert_eq!(parse(&p).unwrap().as_int(), Some((1i128 << 64) - 5));
    assert!(matches!(parse(&p).unwrap(), Value::UInt(_)));
    // 2^64 + 5 does not fit any field of a snapshot: refused.
    let p = [0x80, 4, 0x8a, 9, 5, 0, 0, 0, 0, 0, 0, 0, 1, b'.'];
    assert!(parse(&p).unwrap_err().to_string().contains("outside the 64-bit range"));
    assert_eq!(parse(&[0x80, 4, 0x8a, 1, 0xfe, b'.']).unwrap().as_int(), Some(-2));
    assert_eq!(parse(&[0x80, 4, 0x8a, 0, b'.']).unwrap().as_int(), Some(0));
}

#[test]
fn memo_objects_are_shared_not_copied() {
    // [x, x] where x = [1] is memoised then fetched with BINGET and LONG_BINGET.
    let p = [0x80, 4, b']', 0x94, b']', 0x94, b'K', 1, b'a', b'a', b'h', 1, b'a', b'j', 1, 0, 0, 0, b'a', b'.'];
    let v = parse(&p).unwrap();
    let items = v.items().unwrap();
    assert_eq!(items.len(), 3);
    assert!(items[0].same_object(&items[1]) && items[1].same_object(&items[2]));
}

#[test]
fn only_memo_slots_read_back_are_kept_and_hooks_see_appends() {
    // [x, x, [5]] in protocol 4: x = [1] is memoised and fetched; the
    // outer list and [5] are memoised and never fetched.
    let p =
        [0x80, 4, b']', 0x94, b']', 0x94, b'K', 1, b'a', b'a', b'h', 1, b'a', b']', 0x94, b'K', 5, b'a', b'a', b'.'];
    let bits = fetched_memo(&mut Input::new(&p[..], p.len()));
    assert_eq!(bits, vec![0b10]);
    // A hook that consumes every integer 5 and doubles the others.
    let mut seen = Vec::new();
    let v = parse_stream(|| Ok(&p[..]), p.len(), &mut |list, v| {
        seen.push(list);
        Ok(match v.as_int() {
            Some(5) => None,
            Some(i) => Some(Value::Int(i as i64 * 2)),
            None => Some(v),
        })
    })
    .unwrap();
    let items = v.items().unwrap();
    assert_eq!(items[0].items().unwrap()[0].as_int(), Some(2));
    assert!(items[2].items().unwrap().is_empty());
    assert_eq!(seen.len(), 5);
}

#[test]
fn cycles_are_refused() {
    // l = []; l.append(l) as pickle writes it.
    let e = parse(b"\x80\x04]\x94h\x00a.").unwrap_err().to_string();
    assert!(e.contains("cycle") || e.contains("already shared"), "{e}");
    // A dict set into itself without the memo.
    let e = parse(b"\x80\x04}\x94K\x01h\x00s.").unwrap_err().to_string();
    assert!(e.contains("cycle") || e.contains("already shared"), "{e}");
    // a = []; b = [a]; then a.append(b) through a read-back reference.
    let e = parse(b"\x80\x04]\x94]\x94h\x00a\x94h\x00h\x02a.").unwrap_err();
    assert!(e.to_string().contains("already shared"), "{e}");
    // Python's own recursive list.
    if let Some(p) = python_pickle("(lambda l: (l.append(l), l)[1])([])", 4) {
        assert!(parse(&p).is_err());
    }
}

#[test]
fn code_opcodes_are_refused_with_their_offset() {
    let p = b"\x80\x02cos\nsystem\nq\x00X\x02\x00\x00\x00lsq\x01\x85q\x02Rq\x03.";
    let e = parse(p).unwrap_err();
    assert_eq!(e, PickleError::Unsupported { code: b'c', name: "GLOBAL", offset: 2 });
    assert!(e.to_string().contains("GLOBAL") && e.to_string().contains("byte 2"));
    let e = parse(&[0x80, 4, b'N', b')', b'R', b'.']).unwrap_err();
    assert_eq!(e, PickleError::Unsupported { code: b'R', name: "REDUCE", offset: 4 });
    let e = parse(&[0x80, 4, b'}', b'N', b'b', b'.']).unwrap_err();
    assert!(matches!(e, PickleError::Unsupported { name: "BUILD", .. }));
}

#[test]
fn every_truncation_is_an_error_never_a_panic() {
    let full = match python_pickle(
        "{'segments': [{'address': 2**63 + 7, 'frames': [{'name': 'f', 'line': 3}]*3, 'x': 1.5, 's': 'é'}], 't': (1, None, True)}",
        4,
    ) {
        Some(p) => p,
        None => vec![0x80, 4, b'}', 0x94, 0x8c, 1, b'a', b']', 0x94, b'K', 1, b'a', b's', b'.'],
    };
    assert!(parse(&full).is_ok());
    for cut in 0..full.len() {
        assert!(parse(&full[..cut]).is_err(), "a pickle cut at byte {cut} must not parse");
    }
}

#[test]
fn claimed_lengths_are_checked_before_allocating() {
    // BINUNICODE claiming 4 GiB in a 10-byte file.
    let e = parse(&[0x80, 4, b'X', 0xff, 0xff, 0xff, 0xff, b'a', b'.']).unwrap_err();
    assert!(matches!(e, PickleError::Truncated { what: "a string", .. }), "{e}");
    let e = parse(&[0x80, 4, 0x95, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, b'N', b'.']).unwrap_err();
    assert!(matches!(e, PickleError::Truncated { what: "a FRAME", .. }));
    let e = parse(&[0x80, 4, 0x8a, 200, b'.']).unwrap_err();
    assert!(matches!(e, PickleError::Malformed { .. }));
    let e = parse(&[0x80, 4, b'h', 3, b'.']).unwrap_err();
    assert!(e.to_string().contains("memo entry 3 was never stored"));
    // A memo index of 2^32 − 1: refused without a 512 MiB bitset.
    let e = parse(&[0x80, 4, b'j', 0xff, 0xff, 0xff, 0xff, b'.']).unwrap_err();
    assert!(e.to_string().contains("memo entry 4294967295 was never stored"));
}

#[test]
fn millions_of_values_left_on_the_stack_are_refused() {
    let mut p = vec![0x80, 4];
    p.extend(std::iter::repeat_n(b'N', MAX_STACK + 1));
    p.push(b'.');
    assert_eq!(parse(&p).unwrap_err(), PickleError::TooManyValues { offset: 2 + MAX_STACK + 1 });
    // As many inside a list (APPENDS in batches, as picklers write it)
    // are data, not a stack.
    let mut p = vec![0x80, 4, b']'];
    for _ in 0..(MAX_STACK / 1000 + 2) {
        p.push(b'(');
        p.extend(std::iter::repeat_n(b'N', 1000));
        p.push(b'e');
    }
    p.push(b'.');
    assert!(parse(&p).is_ok());
}

#[test]
fn deep_nesting_is_refused() {
    let mut p = vec![0x80, 4];
    p.extend(std::iter::repeat_n(b'(', MAX_DEPTH + 1));
    p.push(b'.');
    assert_eq!(parse(&p).unwrap_err(), PickleError::TooDeep { offset: 2 + MAX_DEPTH });
    // A million nested lists: parsed and dropped without recursion.
    let n = 1_000_000;
    let mut p = vec![0x80, 4];
    p.extend(std::iter::repeat_n(b']', n));
    p.extend(std::iter::repeat_n(b'a', n - 1));
    p.push(b'.');
    let v = parse(&p).unwrap();
    assert_eq!(v.items().unwrap().len(), 1);
    drop(v);
}

#[test]
fn protocols_2_4_and_5_from_python() {
    let expr = "{'segments': [{'device': 0, 'address': 139821353795584, 'blocks': [{'size': 512, 'state': 'active_allocated'}]}], 'device_traces': [[{'action': 'oom', 'device_free': 2**40, 'time_us': 1748729391819440}]]}";
    for protocol in [2u8, 4, 5] {
        let Some(p) = python_pickle(expr, protocol) else {
            eprintln!("skipped: python3 not found, protocol {protocol} not checked");
            return;
        };
        let v = parse(&p).unwrap_or_else(|e| panic!("protocol {protocol}: {e}"));
        let seg = &v.get("segments").unwrap().items().unwrap()[0];
        assert_eq!(seg.get("address").unwrap().as_int(), Some(139821353795584));
        let blk = &seg.get("blocks").unwrap().items().unwrap()[0];
        assert_eq!(blk.get("state").unwrap().as_str(), Some("active_allocated"));
        let tr = &v.get("device_traces").unwrap().items().unwrap()[0].items().unwrap()[0];
        assert_eq!(tr.get("device_free").unwrap().as_int(), Some(1 << 40));
    }
}

#[test]
fn the_real_snapshot_fixture() {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/pytorch/cs336_ctx128_forward.pickle");
    let Ok(data) = std::fs::read(&path) else {
        eprintln!("skipped: {} is not here (it is only beside the development checkout and CI)", path.display());
        return;
    };
    let v = parse(&data).unwrap();
    let segments = v.get("segments").unwrap().items().unwrap();
    assert_eq!(segments.len(), 516);
    let reserved: i128 = segments.iter().map(|s| s.get("total_size").unwrap().as_int().unwrap()).sum();
    assert_eq!(reserved, 19_667_091_456);
    let trace = v.get("device_traces").unwrap().items().unwrap()[0].items().unwrap();
    assert_eq!(trace.len(), 4657);
    // Frames are shared: consecutive entries from the same call site
    // reuse the memoised frame dicts instead of copies.
    let frames = |i: usize| trace[i].get("frames").unwrap().items().unwrap();
    let shared = (1..trace.len())
        .filter(|&i| frames(i).first().zip(frames(i - 1).first()).is_some_and(|(a, b)| a.same_object(b)))
        .count();
    assert!(shared > trace.len() / 2, "only {shared} entries share frames");
}
