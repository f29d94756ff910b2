//! A process that made calls on several GPUs (a recording's
//! `details.devices`) is replayed per device: each GPU has its own address
//! space and capacity, so one series over all of them would sum what
//! cannot be summed. Each (pid, device) becomes a replay unit of its own,
//! with an id above every pid (Linux pids stay below 2²²), which the report
//! names "PID on GPU N" ([`crate::trace::Trace::units`]). A row without a
//! device (a process's exit) goes to every unit of its process; a row of
//! another device than the process's recorded ones goes to its first.

use std::collections::BTreeMap;

use crate::trace::Trace;
use crate::trace::column::Coded;
use crate::trace::event::{EventKind, Events, NO_DEVICE, Row};

/// The first unit id: above any pid.
pub const FIRST_UNIT: u32 = 1 << 30;

/// The rows after the split (an exit once per unit of its process), and
/// the unit of each, as the pid column holds it.
fn unit_rows<R: Row>(
    events: &Events,
    unit: &BTreeMap<(u32, i32), u32>,
    of_pid: &BTreeMap<u32, Vec<u32>>,
) -> (Vec<R>, Coded<u32>) {
    let mut rows = Vec::with_capacity(events.len());
    let mut pids = Coded::default();
    let _ = pids.try_reserve_exact(events.len());
    for i in 0..events.len() {
        let pid = events.pid[i];
        let Some(units) = of_pid.get(&pid) else {
            rows.push(R::at(i));
            pids.push(pid);
            continue;
        };
        let d = events.device[i];
        if d == NO_DEVICE && events.kind[i] == Some(EventKind::Exit) {
            for &u in units {
                rows.push(R::at(i));
                pids.push(u);
            }
        } else {
            rows.push(R::at(i));
            pids.push(unit.get(&(pid, d)).copied().unwrap_or(units[0]));
        }
    }
    (rows, pids)
}

/// Splits the rows of every process that used several GPUs by device.
pub fn split(trace: &mut Trace, events: &mut Events) {
    let Some(details) = trace.meta.as_ref().and_then(|m| m.details.record()) else { return };
    if events.device.len() != events.len() {
        return;
    }
    let mut unit: BTreeMap<(u32, i32), u32> = BTreeMap::new();
    let mut of_pid: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    for (pid, devices) in &details.devices {
        let Ok(pid) = pid.parse::<u32>() else { continue };
        if devices.len() < 2 {
            continue;
        }
        for &d in devices {
            let id = FIRST_UNIT + unit.len() as u32;
            unit.insert((pid, d), id);
            of_pid.entry(pid).or_default().push(id);
        }
    }
    if unit.is_empty() {
        return;
    }
    // Row numbers in 4 bytes while they fit.
    let pids = if events.len() <= u32::MAX as usize {
        let (rows, pids) = unit_rows::<u32>(events, &unit, &of_pid);
        events.take_rows(&rows);
        pids
    } else {
        let (rows, pids) = unit_rows::<usize>(events, &unit, &of_pid);
        events.take_rows(&rows);
        pids
    };
    events.pid = pids;
    trace.units = unit.into_iter().map(|((pid, d), id)| (id, (pid, d))).collect();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::details::{Details, RecordDetails};
    use crate::trace::event::Event;
    use crate::trace::{Source, TraceMeta};

    fn trace(devices: &[(u32, &[i32])]) -> Trace {
        let mut meta = TraceMeta::new(Source::Ebpf);
        meta.details = Details::Record(RecordDetails {
            devices: devices.iter().map(|(p, d)| (p.to_string(), d.to_vec())).collect(),
            ..RecordDetails::default()
        });
        Trace { dir: "t".into(), name: "t".into(), meta: Some(meta), device_column: true, ..Trace::default() }
    }

    #[test]
    fn each_device_of_a_process_is_a_unit_and_its_exit_goes_to_all() {
        let mut t = trace(&[(7, &[0, 2]), (9, &[0])]);
        let mut ev = Events::default();
        for (ts, pid, kind, device) in [
            (1, 7, EventKind::Alloc, 0),
            (2, 7, EventKind::Alloc, 2),
            (3, 9, EventKind::Alloc, 0),
            (4, 7, EventKind::Free, 2),
            (5, 7, EventKind::Exit, NO_DEVICE),
            (6, 7, EventKind::Alloc, 5), // a device not in the list: the first
        ] {
            ev.push(&Event::new(ts, pid, kind, ts, 1));
            ev.device.push(device);
        }
        split(&mut t, &mut ev);
        let (u0, u2) = (FIRST_UNIT, FIRST_UNIT + 1);
        assert_eq!(t.units, BTreeMap::from([(u0, (7, 0)), (u2, (7, 2))]));
        assert_eq!(ev.ts_ns, vec![1, 2, 3, 4, 5, 5, 6]);
        assert_eq!(ev.pid, vec![u0, u2, 9, u2, u0, u2, u0]);
    }

    #[test]
    fn nothing_changes_when_every_process_used_one_device() {
        let mut t = trace(&[(7, &[1])]);
        let mut ev = Events::default();
        ev.push(&Event::new(1, 7, EventKind::Alloc, 1, 1));
        ev.device.push(1);
        let before = ev.clone();
        split(&mut t, &mut ev);
        assert_eq!(ev, before);
        assert!(t.units.is_empty());
    }
}
