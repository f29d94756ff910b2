use super::*;
use crate::trace::details::ReservedSample;

#[test]
fn map_in_parallel_keeps_the_order_of_a_sequential_map() {
    // Items of uneven cost, more than there are threads.
    let items: Vec<u64> = (0..37).map(|i| (i * 7919) % 101).collect();
    let f = |&n: &u64| (0..n * 1000).fold(n, |a, x| a.wrapping_mul(31).wrapping_add(x));
    assert_eq!(map_in_parallel(&items, f), items.iter().map(f).collect::<Vec<_>>());
    assert!(map_in_parallel(&[] as &[u64], f).is_empty());
}

fn row(t_ns: u64, pid: u32) -> Row {
    Row {
        step: 0,
        t_ns,
        pid,
        at_oom: false,
        metrics: Metrics::default(),
        forecast: None,
        risk_online: None,
        oom_risk_online: None,
        alloc: None,
        iteration: None,
        reported_reserved: None,
    }
}

/// The latest sample at or before each row, summed over the process's
/// devices; a sample at the row's own time counts; other processes'
/// samples do not.
#[test]
fn reported_reserved_is_the_latest_sample_per_device() {
    let s = |t_ns, pid, device, bytes| ReservedSample { t_ns, pid, device, bytes };
    let series = [s(20, 1, 0, 100), s(10, 1, 0, 50), s(30, 1, 1, 7), s(30, 2, 0, 1000), s(40, 1, 0, 80)];
    let mut rows: Vec<Row> = [5, 10, 19, 20, 30, 39, 40, 50].iter().map(|&t| row(t, 1)).collect();
    rows.push(row(25, 2));
    rows.push(row(35, 2));
    fill_reported_reserved(&series, &mut rows);
    let got: Vec<Option<u64>> = rows.iter().map(|r| r.reported_reserved).collect();
    assert_eq!(
        got,
        vec![None, Some(50), Some(50), Some(100), Some(107), Some(107), Some(87), Some(87), None, Some(1000)]
    );
}
