//! A reader for the pickle subset PyTorch memory snapshots are written in
//! (SPEC §8), for `import` (issue #6, in progress). Not a general
//! unpickler: it knows the data opcodes of protocols 2–5 and refuses every
//! other one (GLOBAL, REDUCE, BUILD, …) with its name and byte offset —
//! nothing is ever executed or emulated.
//!
//! Objects put in the memo are shared, not copied: a frame list referenced
//! hundreds of times is one allocation (`Rc`). The reader is iterative (no
//! recursion on nesting), bounds the nesting depth, and checks every length
//! the stream claims against the bytes that are really there, so a hostile
//! or truncated file gives an error, never a panic or a huge allocation.
//!
//! Written by hand because no maintained crate reads pickles without also
//! being able to construct arbitrary objects (serde-pickle resolves some
//! globals) or without deep-copying memoised objects.

use std::cell::RefCell;
use std::rc::Rc;

use ahash::AHashMap;

/// Deepest MARK nesting accepted (snapshots nest a handful of levels).
pub const MAX_DEPTH: usize = 10_000;

/// Why a pickle could not be read.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PickleError {
    #[error(
        "unsupported pickle opcode {name} (0x{code:02x}) at byte {offset}: memory snapshots hold only plain data, \
         so this file is not one (or was tampered with); fragscope never executes pickled code"
    )]
    Unsupported { code: u8, name: &'static str, offset: usize },
    #[error("truncated pickle: {what} at byte {offset} needs {needed} more byte(s) than the file has")]
    Truncated { what: &'static str, offset: usize, needed: usize },
    #[error("malformed pickle at byte {offset}: {why}")]
    Malformed { offset: usize, why: String },
    #[error("pickle nests deeper than {MAX_DEPTH} levels at byte {offset}")]
    TooDeep { offset: usize },
}

/// A pickled value. Lists and dicts are shared (`Rc`) because the memo
/// hands out the same object many times; dicts keep insertion order.
#[derive(Clone, Debug)]
pub enum Value {
    None,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(Rc<str>),
    List(Rc<RefCell<Vec<Value>>>),
    Tuple(Rc<[Value]>),
    Dict(Rc<RefCell<Vec<(Value, Value)>>>),
}

impl Value {
    /// For a dict with string keys: the value of `key`.
    pub fn get(&self, key: &str) -> Option<Value> {
        match self {
            Value::Dict(d) => {
                d.borrow().iter().find(|(k, _)| matches!(k, Value::Str(s) if &**s == key)).map(|p| p.1.clone())
            }
            _ => None,
        }
    }

    pub fn as_int(&self) -> Option<i128> {
        match self {
            Value::Int(i) => Some(*i),
            Value::Bool(b) => Some(i128::from(*b)),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// Elements of a list or tuple (a cheap copy of the element handles).
    pub fn items(&self) -> Option<Vec<Value>> {
        match self {
            Value::List(l) => Some(l.borrow().clone()),
            Value::Tuple(t) => Some(t.to_vec()),
            _ => None,
        }
    }

    /// Whether two values are the same shared object (memo sharing).
    pub fn same_object(&self, other: &Value) -> bool {
        match (self, other) {
            (Value::List(a), Value::List(b)) => Rc::ptr_eq(a, b),
            (Value::Dict(a), Value::Dict(b)) => Rc::ptr_eq(a, b),
            (Value::Tuple(a), Value::Tuple(b)) => Rc::ptr_eq(a, b),
            (Value::Str(a), Value::Str(b)) => Rc::ptr_eq(a, b),
            _ => false,
        }
    }
}

/// Dropping is iterative: a hostile file nesting a million lists must not
/// overflow the stack when its value goes away.
impl Drop for Value {
    fn drop(&mut self) {
        fn detach(v: &mut Value, work: &mut Vec<Value>) {
            match v {
                Value::List(l) if Rc::strong_count(l) == 1 => work.append(&mut l.borrow_mut()),
                Value::Dict(d) if Rc::strong_count(d) == 1 => {
                    for (k, x) in d.borrow_mut().drain(..) {
                        work.push(k);
                        work.push(x);
                    }
                }
                Value::Tuple(t) => {
                    if let Some(items) = Rc::get_mut(t) {
                        work.extend(items.iter_mut().map(|x| std::mem::replace(x, Value::None)));
                    }
                }
                _ => {}
            }
        }
        let mut work = Vec::new();
        detach(self, &mut work);
        while let Some(mut v) = work.pop() {
            detach(&mut v, &mut work);
        }
    }
}

/// Names of opcodes this reader refuses, for the error message.
fn opcode_name(code: u8) -> &'static str {
    match code {
        b'c' => "GLOBAL",
        0x93 => "STACK_GLOBAL",
        b'R' => "REDUCE",
        b'b' => "BUILD",
        b'i' => "INST",
        b'o' => "OBJ",
        0x81 => "NEWOBJ",
        0x92 => "NEWOBJ_EX",
        b'P' => "PERSID",
        b'Q' => "BINPERSID",
        0x82..=0x84 => "EXT",
        b'I' => "INT",
        b'L' => "LONG",
        0x8b => "LONG4",
        b'F' => "FLOAT",
        b'S' | b'T' | b'U' => "STRING",
        b'V' => "UNICODE",
        0x8d => "BINUNICODE8",
        b'B' | b'C' | 0x8e => "BINBYTES",
        0x96 | 0x97 => "BYTEARRAY/BUFFER",
        0x90 | 0x91 => "SET",
        b'0' => "POP",
        b'1' => "DUP",
        b'2' => "POP_MARK",
        b'g' => "GET",
        b'p' => "PUT",
        _ => "unknown",
    }
}

struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], PickleError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.data.len()).ok_or(PickleError::Truncated {
            what,
            offset: self.pos,
            needed: n - (self.data.len() - self.pos).min(n),
        })?;
        let s = &self.data[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, PickleError> {
        Ok(self.take(1, what)?[0])
    }

    fn u16(&mut self, what: &'static str) -> Result<u16, PickleError> {
        let b = self.take(2, what)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, PickleError> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
}

/// Parses a whole pickle held in memory (a read file or a memory map).
pub fn parse(data: &[u8]) -> Result<Value, PickleError> {
    let mut r = Reader { data, pos: 0 };
    let mut stack: Vec<Value> = Vec::new();
    let mut marks: Vec<usize> = Vec::new();
    let mut memo: AHashMap<u32, Value> = AHashMap::new();
    let malformed = |offset: usize, why: &str| PickleError::Malformed { offset, why: why.to_string() };
    loop {
        let at = r.pos;
        let code = match r.take(1, "an opcode") {
            Ok(b) => b[0],
            Err(_) => return Err(PickleError::Truncated { what: "the STOP opcode", offset: at, needed: 1 }),
        };
        let pop = |stack: &mut Vec<Value>| stack.pop().ok_or_else(|| malformed(at, "stack underflow"));
        let pop_mark = |stack: &mut Vec<Value>, marks: &mut Vec<usize>| -> Result<Vec<Value>, PickleError> {
            let m = marks.pop().ok_or_else(|| malformed(at, "no MARK to pop to"))?;
            if m > stack.len() {
                return Err(malformed(at, "MARK above the stack"));
            }
            Ok(stack.split_off(m))
        };
        match code {
            0x80 => {
                let v = r.u8("PROTO's version")?;
                if !(2..=5).contains(&v) {
                    return Err(malformed(at, &format!("protocol {v}; snapshots use protocols 2 to 5")));
                }
            }
            0x95 => {
                let b = r.take(8, "FRAME's length")?;
                let n = u64::from_le_bytes(b.try_into().unwrap_or([0; 8]));
                if n > (data.len() - r.pos) as u64 {
                    return Err(PickleError::Truncated {
                        what: "a FRAME",
                        offset: at,
                        needed: (n - (data.len() - r.pos) as u64) as usize,
                    });
                }
            }
            0x94 => {
                let top = stack.last().ok_or_else(|| malformed(at, "MEMOIZE on an empty stack"))?.clone();
                let idx = memo.len() as u32;
                memo.insert(idx, top);
            }
            b'q' | b'r' => {
                let idx = if code == b'q' { u32::from(r.u8("BINPUT's index")?) } else { r.u32("LONG_BINPUT's index")? };
                let top = stack.last().ok_or_else(|| malformed(at, "PUT on an empty stack"))?.clone();
                memo.insert(idx, top);
            }
            b'h' | b'j' => {
                let idx = if code == b'h' { u32::from(r.u8("BINGET's index")?) } else { r.u32("LONG_BINGET's index")? };
                let v = memo.get(&idx).ok_or_else(|| malformed(at, &format!("memo entry {idx} was never stored")))?;
                stack.push(v.clone());
            }
            b'(' => {
                if marks.len() >= MAX_DEPTH {
                    return Err(PickleError::TooDeep { offset: at });
                }
                marks.push(stack.len());
            }
            b'}' => stack.push(Value::Dict(Rc::new(RefCell::new(Vec::new())))),
            b']' => stack.push(Value::List(Rc::new(RefCell::new(Vec::new())))),
            b')' => stack.push(Value::Tuple(Rc::from(Vec::new()))),
            b'd' | b'u' => {
                let items = pop_mark(&mut stack, &mut marks)?;
                if items.len() % 2 != 0 {
                    return Err(malformed(at, "odd number of items for a dict"));
                }
                let mut pairs = Vec::with_capacity(items.len() / 2);
                let mut it = items.into_iter();
                while let (Some(k), Some(v)) = (it.next(), it.next()) {
                    pairs.push((k, v));
                }
                if code == b'd' {
                    stack.push(Value::Dict(Rc::new(RefCell::new(pairs))));
                } else {
                    match stack.last() {
                        Some(Value::Dict(d)) => d.borrow_mut().extend(pairs),
                        _ => return Err(malformed(at, "SETITEMS on something that is not a dict")),
                    }
                }
            }
            b's' => {
                let v = pop(&mut stack)?;
                let k = pop(&mut stack)?;
                match stack.last() {
                    Some(Value::Dict(d)) => d.borrow_mut().push((k, v)),
                    _ => return Err(malformed(at, "SETITEM on something that is not a dict")),
                }
            }
            b'l' => {
                let items = pop_mark(&mut stack, &mut marks)?;
                stack.push(Value::List(Rc::new(RefCell::new(items))));
            }
            b'a' => {
                let v = pop(&mut stack)?;
                match stack.last() {
                    Some(Value::List(l)) => l.borrow_mut().push(v),
                    _ => return Err(malformed(at, "APPEND to something that is not a list")),
                }
            }
            b'e' => {
                let items = pop_mark(&mut stack, &mut marks)?;
                match stack.last() {
                    Some(Value::List(l)) => l.borrow_mut().extend(items),
                    _ => return Err(malformed(at, "APPENDS to something that is not a list")),
                }
            }
            b't' => {
                let items = pop_mark(&mut stack, &mut marks)?;
                stack.push(Value::Tuple(Rc::from(items)));
            }
            0x85..=0x87 => {
                let n = usize::from(code - 0x84);
                if stack.len() < n {
                    return Err(malformed(at, "stack underflow"));
                }
                let items = stack.split_off(stack.len() - n);
                stack.push(Value::Tuple(Rc::from(items)));
            }
            0x8c | b'X' => {
                let n = if code == 0x8c {
                    usize::from(r.u8("a string length")?)
                } else {
                    r.u32("a string length")? as usize
                };
                let bytes = r.take(n, "a string")?;
                let s = std::str::from_utf8(bytes).map_err(|e| malformed(at, &format!("string is not UTF-8: {e}")))?;
                stack.push(Value::Str(Rc::from(s)));
            }
            b'J' => {
                let b = r.take(4, "BININT")?;
                stack.push(Value::Int(i128::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]]))));
            }
            b'K' => stack.push(Value::Int(i128::from(r.u8("BININT1")?))),
            b'M' => stack.push(Value::Int(i128::from(r.u16("BININT2")?))),
            0x8a => {
                let n = usize::from(r.u8("LONG1's length")?);
                if n > 16 {
                    return Err(malformed(at, &format!("integer of {n} bytes; at most 16 are supported")));
                }
                let b = r.take(n, "LONG1's bytes")?;
                let mut buf = [if b.last().is_some_and(|x| x & 0x80 != 0) { 0xff } else { 0 }; 16];
                buf[..n].copy_from_slice(b);
                stack.push(Value::Int(i128::from_le_bytes(buf)));
            }
            b'N' => stack.push(Value::None),
            0x88 => stack.push(Value::Bool(true)),
            0x89 => stack.push(Value::Bool(false)),
            b'G' => {
                let b = r.take(8, "BINFLOAT")?;
                stack.push(Value::Float(f64::from_be_bytes(b.try_into().unwrap_or([0; 8]))));
            }
            b'.' => {
                let v = pop(&mut stack)?;
                return Ok(v);
            }
            _ => return Err(PickleError::Unsupported { code, name: opcode_name(code), offset: at }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs Python's own pickle writer when python3 is there; None (and a
    /// visible note) when it is not.
    fn python_pickle(expr: &str, protocol: u8) -> Option<Vec<u8>> {
        let out = std::process::Command::new("python3")
            .args([
                "-c",
                &format!("import pickle,sys; sys.stdout.buffer.write(pickle.dumps({expr}, protocol={protocol}))"),
            ])
            .output()
            .ok()?;
        if !out.status.success() {
            eprintln!("skipped: python3 could not pickle {expr}");
            return None;
        }
        Some(out.stdout)
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
        // 2^64 + 5 in 9 bytes; −2 in 1 byte.
        let p = [0x80, 4, 0x8a, 9, 5, 0, 0, 0, 0, 0, 0, 0, 1, b'.'];
        assert_eq!(parse(&p).unwrap().as_int(), Some((1i128 << 64) + 5));
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
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../shared/fixtures/pytorch/cs336_ctx128_forward.pickle");
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
}
