//! A reader for the pickle subset PyTorch memory snapshots are written in
//! (SPEC §8), for `import` and for `analyze` of a snapshot. Not a general
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
//! Memory. A pickler memoises every object it writes, so a naive reader
//! keeps every trace entry alive through its memo. This one streams the
//! file twice through a small buffer: the first pass only notes which memo
//! slots are ever read back (`BINGET`), the second keeps just those. And
//! [`parse_stream`] hands every item appended to a list to a hook, which may
//! consume it (the snapshot reader turns trace entries into 40-byte structs
//! there), so millions of entry dicts never exist at once. Values are 16
//! bytes.
//!
//! [`write`] writes the same data subset as a protocol-4 pickle, with memo
//! sharing, for `export --format memory-viz`.
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
    #[error("cannot read the pickle at byte {offset}: {why}")]
    Io { offset: usize, why: String },
}

/// A pickled value. Lists and dicts are shared (`Rc`) because the memo
/// hands out the same object many times; dicts keep insertion order.
/// Integers hold the signed 64-bit range, and `UInt` the unsigned values
/// above it (device addresses ≥ 2^63 occur); larger ones are refused.
#[derive(Clone, Debug)]
pub enum Value {
    None,
    Bool(bool),
    Int(i64),
    UInt(u64),
    Float(f64),
    Str(Rc<String>),
    List(Rc<RefCell<Vec<Value>>>),
    Tuple(Rc<Vec<Value>>),
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
            Value::Int(i) => Some(i128::from(*i)),
            Value::UInt(u) => Some(i128::from(*u)),
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
    #[cfg(test)]
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
/// overflow the stack when its value goes away. Only containers this value
/// owns alone are queued (so dropping a dict of numbers and shared handles
/// allocates nothing).
impl Drop for Value {
    fn drop(&mut self) {
        fn unique_container(v: &Value) -> bool {
            match v {
                Value::List(l) => Rc::strong_count(l) == 1,
                Value::Dict(d) => Rc::strong_count(d) == 1,
                Value::Tuple(t) => Rc::strong_count(t) == 1,
                _ => false,
            }
        }
        fn detach(v: &mut Value, work: &mut Vec<Value>) {
            let mut keep = |x: Value| {
                if unique_container(&x) {
                    work.push(x);
                }
            };
            match v {
                Value::List(l) if Rc::strong_count(l) == 1 => l.borrow_mut().drain(..).for_each(&mut keep),
                Value::Dict(d) if Rc::strong_count(d) == 1 => {
                    for (k, x) in d.borrow_mut().drain(..) {
                        keep(k);
                        keep(x);
                    }
                }
                Value::Tuple(t) => {
                    if let Some(items) = Rc::get_mut(t) {
                        items.drain(..).for_each(&mut keep);
                    }
                }
                _ => {}
            }
        }
        if !unique_container(self) {
            return;
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

/// A buffered reader over any byte source whose length is known, so that
/// every length the stream claims is checked against what is left before
/// anything is allocated.
struct Input<R: std::io::Read> {
    src: R,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    /// Byte offset of `buf[start]` in the stream.
    pos: usize,
    len: usize,
}

const BUF: usize = 1 << 16;

impl<R: std::io::Read> Input<R> {
    fn new(src: R, len: usize) -> Self {
        Input { src, buf: vec![0; BUF].into_boxed_slice(), start: 0, end: 0, pos: 0, len }
    }

    fn truncated(&self, what: &'static str, n: usize) -> PickleError {
        PickleError::Truncated { what, offset: self.pos, needed: n - (self.len - self.pos).min(n) }
    }

    fn fill(&mut self, what: &'static str, n: usize) -> Result<(), PickleError> {
        if self.pos.checked_add(n).is_none_or(|e| e > self.len) {
            return Err(self.truncated(what, n));
        }
        if self.end - self.start >= n {
            return Ok(());
        }
        self.buf.copy_within(self.start..self.end, 0);
        self.end -= self.start;
        self.start = 0;
        if n > self.buf.len() {
            let mut bigger = vec![0; n.next_power_of_two()].into_boxed_slice();
            bigger[..self.end].copy_from_slice(&self.buf[..self.end]);
            self.buf = bigger;
        }
        while self.end < n {
            match self.src.read(&mut self.buf[self.end..]) {
                Ok(0) => return Err(self.truncated(what, n)),
                Ok(k) => self.end += k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(PickleError::Io { offset: self.pos, why: e.to_string() }),
            }
        }
        Ok(())
    }

    /// The next `n` bytes (valid until the next call).
    fn take(&mut self, n: usize, what: &'static str) -> Result<&[u8], PickleError> {
        self.fill(what, n)?;
        let s = &self.buf[self.start..self.start + n];
        self.start += n;
        self.pos += n;
        Ok(s)
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, PickleError> {
        if self.start < self.end {
            let b = self.buf[self.start];
            self.start += 1;
            self.pos += 1;
            return Ok(b);
        }
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

    fn skip(&mut self, n: usize, what: &'static str) -> Result<(), PickleError> {
        let mut left = n;
        while left > 0 {
            let k = left.min(BUF);
            self.take(k, what)?;
            left -= k;
        }
        Ok(())
    }
}

/// Pass one: the memo slots that are ever read back. Stops quietly at the
/// first thing it does not understand; pass two reports it.
fn fetched_memo<R: std::io::Read>(input: &mut Input<R>) -> Vec<u64> {
    let mut bits: Vec<u64> = Vec::new();
    // A slot beyond the stream's length can never have been stored (each
    // store takes a byte): not noted, so a hostile index costs nothing here
    // and pass two reports it.
    let limit = input.len;
    let mut note = |i: u32| {
        if i as usize > limit {
            return;
        }
        let (w, b) = ((i / 64) as usize, i % 64);
        if bits.len() <= w {
            bits.resize(w + 1, 0);
        }
        bits[w] |= 1 << b;
    };
    loop {
        let Ok(code) = input.u8("") else { break };
        let step = match code {
            0x80 | b'K' | b'q' => input.skip(1, ""),
            0x95 | b'G' => input.skip(8, ""),
            b'M' => input.skip(2, ""),
            b'J' | b'r' => input.skip(4, ""),
            b'h' => input.u8("").map(|i| note(u32::from(i))),
            b'j' => input.u32("").map(&mut note),
            0x8c | 0x8a => input.u8("").and_then(|n| input.skip(usize::from(n), "")),
            b'X' => input.u32("").and_then(|n| input.skip(n as usize, "")),
            0x94
            | b'('
            | b'}'
            | b']'
            | b')'
            | b'd'
            | b'u'
            | b's'
            | b'l'
            | b'a'
            | b'e'
            | b't'
            | 0x85..=0x87
            | b'N'
            | 0x88
            | 0x89 => Ok(()),
            _ => break, // STOP, or an opcode pass two will refuse
        };
        if step.is_err() {
            break;
        }
    }
    bits
}

/// What a list hook decides for an item being appended: keep it (possibly
/// replaced) or drop it (the hook consumed it).
pub type Hook<'h> = &'h mut dyn FnMut(usize, Value) -> Result<Option<Value>, String>;

/// Parses a whole pickle held in memory: the entry point of the fuzz target
/// (`fuzz/fuzz_targets/pickle.rs`) and of the tests; the importer streams.
#[cfg_attr(not(test), allow(dead_code))]
pub fn parse(data: &[u8]) -> Result<Value, PickleError> {
    parse_stream(|| Ok(data), data.len(), &mut |_, v| Ok(Some(v)))
}

/// Parses a pickle of `len` bytes that `open` can read from the start
/// (twice: see the module documentation). `hook(list, item)` sees every
/// item appended to a list (`list` identifies the list: the address of its
/// shared cell, stable while it lives).
pub fn parse_stream<R: std::io::Read>(
    mut open: impl FnMut() -> std::io::Result<R>,
    len: usize,
    hook: Hook<'_>,
) -> Result<Value, PickleError> {
    let io = |e: std::io::Error| PickleError::Io { offset: 0, why: e.to_string() };
    let fetched = fetched_memo(&mut Input::new(open().map_err(io)?, len));
    let wanted = |i: u32| fetched.get((i / 64) as usize).is_some_and(|w| w & (1 << (i % 64)) != 0);
    let mut r = Input::new(open().map_err(io)?, len);
    let mut stack: Vec<Value> = Vec::new();
    let mut marks: Vec<usize> = Vec::new();
    let mut memo: AHashMap<u32, Value> = AHashMap::new();
    let mut memo_len: u32 = 0;
    // Cycles (which Rc would leak) are refused. A container that was read
    // back from the memo is never modified; so a container receiving items
    // has never been read back and sits on the stack, where nothing contains
    // it: the only cycle left is inserting it into itself, checked per item.
    // Snapshots (trees with shared leaves) never trip either rule.
    let mut shared: ahash::AHashSet<usize> = Default::default();
    let malformed = |offset: usize, why: &str| PickleError::Malformed { offset, why: why.to_string() };
    loop {
        let at = r.pos;
        let code = match r.u8("an opcode") {
            Ok(b) => b,
            Err(PickleError::Truncated { .. }) => {
                return Err(PickleError::Truncated { what: "the STOP opcode", offset: at, needed: 1 });
            }
            Err(e) => return Err(e),
        };
        let pop = |stack: &mut Vec<Value>| stack.pop().ok_or_else(|| malformed(at, "stack underflow"));
        // The stack position of the innermost MARK, popped.
        let mark = |stack: &Vec<Value>, marks: &mut Vec<usize>| -> Result<usize, PickleError> {
            let m = marks.pop().ok_or_else(|| malformed(at, "no MARK to pop to"))?;
            if m > stack.len() {
                return Err(malformed(at, "MARK above the stack"));
            }
            Ok(m)
        };
        let pop_mark = |stack: &mut Vec<Value>, marks: &mut Vec<usize>| -> Result<Vec<Value>, PickleError> {
            let m = mark(stack, marks)?;
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
                if n > (r.len - r.pos) as u64 {
                    return Err(PickleError::Truncated {
                        what: "a FRAME",
                        offset: at,
                        needed: (n - (r.len - r.pos) as u64) as usize,
                    });
                }
            }
            0x94 | b'q' | b'r' => {
                let idx = match code {
                    0x94 => memo_len,
                    b'q' => u32::from(r.u8("BINPUT's index")?),
                    _ => r.u32("LONG_BINPUT's index")?,
                };
                // MEMOIZE numbers objects by the memo's size; picklers
                // write PUT indices in the same sequence.
                if idx == memo_len {
                    memo_len = memo_len.saturating_add(1);
                }
                let top = stack.last().ok_or_else(|| malformed(at, "memoising on an empty stack"))?;
                if wanted(idx) {
                    memo.insert(idx, top.clone());
                }
            }
            b'h' | b'j' => {
                let idx = if code == b'h' { u32::from(r.u8("BINGET's index")?) } else { r.u32("LONG_BINGET's index")? };
                let v = memo.get(&idx).ok_or_else(|| malformed(at, &format!("memo entry {idx} was never stored")))?;
                if let Some(p) = container(v) {
                    shared.insert(p);
                }
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
            b')' => stack.push(Value::Tuple(Rc::new(Vec::new()))),
            b'd' | b'u' => {
                let m = mark(&stack, &mut marks)?;
                if (stack.len() - m) % 2 != 0 {
                    return Err(malformed(at, "odd number of items for a dict"));
                }
                let target = if code == b'd' {
                    Rc::new(RefCell::new(Vec::with_capacity((stack.len() - m) / 2)))
                } else {
                    match m.checked_sub(1).map(|i| &stack[i]) {
                        Some(Value::Dict(d)) if !shared.contains(&(Rc::as_ptr(d) as *const u8 as usize)) => {
                            Rc::clone(d)
                        }
                        Some(Value::Dict(_)) => return Err(malformed(at, "SETITEMS on a dict already shared")),
                        _ => return Err(malformed(at, "SETITEMS on something that is not a dict")),
                    }
                };
                let me = Rc::as_ptr(&target) as *const u8 as usize;
                if stack[m..].iter().any(|x| container(x) == Some(me)) {
                    return Err(malformed(at, "a dict inserted into itself (a cycle)"));
                }
                {
                    let mut pairs = target.borrow_mut();
                    let mut it = stack.drain(m..);
                    while let (Some(k), Some(v)) = (it.next(), it.next()) {
                        pairs.push((k, v));
                    }
                }
                if code == b'd' {
                    stack.push(Value::Dict(target));
                }
            }
            b's' => {
                let v = pop(&mut stack)?;
                let k = pop(&mut stack)?;
                if stack.last().and_then(container).is_some_and(|me| [&k, &v].iter().any(|x| container(x) == Some(me)))
                {
                    return Err(malformed(at, "a dict inserted into itself (a cycle)"));
                }
                match stack.last() {
                    Some(Value::Dict(d)) if !shared.contains(&(Rc::as_ptr(d) as *const u8 as usize)) => {
                        d.borrow_mut().push((k, v))
                    }
                    Some(Value::Dict(_)) => return Err(malformed(at, "SETITEM on a dict already shared")),
                    _ => return Err(malformed(at, "SETITEM on something that is not a dict")),
                }
            }
            b'l' => {
                let items = pop_mark(&mut stack, &mut marks)?;
                let list = Rc::new(RefCell::new(Vec::with_capacity(items.len())));
                append(&list, items.into_iter(), hook).map_err(|why| malformed(at, &why))?;
                stack.push(Value::List(list));
            }
            b'a' | b'e' => {
                let m = if code == b'a' {
                    stack.len().checked_sub(1).ok_or_else(|| malformed(at, "stack underflow"))?
                } else {
                    mark(&stack, &mut marks)?
                };
                let list = match m.checked_sub(1).map(|i| &stack[i]) {
                    Some(Value::List(l)) if !shared.contains(&(Rc::as_ptr(l) as *const u8 as usize)) => Rc::clone(l),
                    Some(Value::List(_)) => return Err(malformed(at, "APPEND to a list already shared")),
                    _ => return Err(malformed(at, "APPEND to something that is not a list")),
                };
                append(&list, stack.drain(m..), hook).map_err(|why| malformed(at, &why))?;
            }
            b't' => {
                let items = pop_mark(&mut stack, &mut marks)?;
                stack.push(Value::Tuple(Rc::new(items)));
            }
            0x85..=0x87 => {
                let n = usize::from(code - 0x84);
                if stack.len() < n {
                    return Err(malformed(at, "stack underflow"));
                }
                let items = stack.split_off(stack.len() - n);
                stack.push(Value::Tuple(Rc::new(items)));
            }
            0x8c | b'X' => {
                let n = if code == 0x8c {
                    usize::from(r.u8("a string length")?)
                } else {
                    r.u32("a string length")? as usize
                };
                let bytes = r.take(n, "a string")?;
                let s = std::str::from_utf8(bytes).map_err(|e| malformed(at, &format!("string is not UTF-8: {e}")))?;
                stack.push(Value::Str(Rc::new(s.to_string())));
            }
            b'J' => {
                let b = r.take(4, "BININT")?;
                stack.push(Value::Int(i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]]))));
            }
            b'K' => stack.push(Value::Int(i64::from(r.u8("BININT1")?))),
            b'M' => stack.push(Value::Int(i64::from(r.u16("BININT2")?))),
            0x8a => {
                let n = usize::from(r.u8("LONG1's length")?);
                if n > 9 {
                    return Err(malformed(at, &format!("integer of {n} bytes; snapshots use at most 9")));
                }
                let b = r.take(n, "LONG1's bytes")?;
                let mut buf = [if b.last().is_some_and(|x| x & 0x80 != 0) { 0xff } else { 0 }; 16];
                buf[..n].copy_from_slice(b);
                let v = i128::from_le_bytes(buf);
                stack.push(match (i64::try_from(v), u64::try_from(v)) {
                    (Ok(i), _) => Value::Int(i),
                    (_, Ok(u)) => Value::UInt(u),
                    _ => return Err(malformed(at, &format!("integer {v} is outside the 64-bit range"))),
                });
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

/// Writes `v` as a protocol-4 pickle, as CPython's `pickle.dump(v,
/// protocol=4)` would read it back. Shared lists, dicts and strings (the
/// same `Rc`) are written once and referenced through the memo, as
/// PyTorch's own snapshots share their frame lists; without that a
/// snapshot of millions of entries would repeat every frame. Written by
/// hand next to the reader: `serde-pickle` writes protocol 3 and has no
/// memo sharing.
pub fn write<W: std::io::Write>(v: &Value, out: W) -> std::io::Result<()> {
    use std::io::Write as _;
    let mut w = Writer { out: std::io::BufWriter::with_capacity(1 << 20, out), memo: AHashMap::new() };
    w.out.write_all(&[0x80, 4])?;
    w.value(v)?;
    w.out.write_all(b".")?;
    w.out.flush()
}

struct Writer<W: std::io::Write> {
    out: std::io::BufWriter<W>,
    /// Shared object → its memo index.
    memo: AHashMap<usize, u32>,
}

use std::io::Write as _;

impl<W: std::io::Write> Writer<W> {
    /// For a shared object seen before: writes the memo reference and
    /// returns true.
    fn recall(&mut self, id: usize) -> std::io::Result<bool> {
        match self.memo.get(&id) {
            Some(&i) if i < 256 => self.out.write_all(&[b'h', i as u8]).map(|_| true),
            Some(&i) => {
                self.out.write_all(b"j")?;
                self.out.write_all(&i.to_le_bytes()).map(|_| true)
            }
            None => Ok(false),
        }
    }

    fn memoize(&mut self, id: usize) -> std::io::Result<()> {
        let i = self.memo.len() as u32;
        self.memo.insert(id, i);
        self.out.write_all(&[0x94])
    }

    fn int(&mut self, v: i128) -> std::io::Result<()> {
        if let Ok(i) = i32::try_from(v) {
            self.out.write_all(b"J")?;
            return self.out.write_all(&i.to_le_bytes());
        }
        // LONG1: little-endian two's complement, as short as it goes.
        let bytes = v.to_le_bytes();
        let mut n = 16;
        while n > 1 {
            let (last, prev) = (bytes[n - 1], bytes[n - 2]);
            if (last == 0 && prev & 0x80 == 0) || (last == 0xff && prev & 0x80 != 0) {
                n -= 1;
            } else {
                break;
            }
        }
        self.out.write_all(&[0x8a, n as u8])?;
        self.out.write_all(&bytes[..n])
    }

    fn value(&mut self, v: &Value) -> std::io::Result<()> {
        match v {
            Value::None => self.out.write_all(b"N"),
            Value::Bool(true) => self.out.write_all(&[0x88]),
            Value::Bool(false) => self.out.write_all(&[0x89]),
            Value::Int(i) => self.int(i128::from(*i)),
            Value::UInt(u) => self.int(i128::from(*u)),
            Value::Float(f) => {
                self.out.write_all(b"G")?;
                self.out.write_all(&f.to_be_bytes())
            }
            Value::Str(s) => {
                let id = Rc::as_ptr(s) as usize;
                if self.recall(id)? {
                    return Ok(());
                }
                let b = s.as_bytes();
                if b.len() < 256 {
                    self.out.write_all(&[0x8c, b.len() as u8])?;
                } else {
                    self.out.write_all(b"X")?;
                    self.out.write_all(&(b.len() as u32).to_le_bytes())?;
                }
                self.out.write_all(b)?;
                if Rc::strong_count(s) > 1 {
                    self.memoize(id)?;
                }
                Ok(())
            }
            Value::List(l) => {
                let id = Rc::as_ptr(l) as *const u8 as usize;
                if self.recall(id)? {
                    return Ok(());
                }
                self.out.write_all(b"]")?;
                self.memoize(id)?;
                for chunk in l.borrow().chunks(1000) {
                    self.out.write_all(b"(")?;
                    for x in chunk {
                        self.value(x)?;
                    }
                    self.out.write_all(b"e")?;
                }
                Ok(())
            }
            Value::Tuple(t) => {
                self.out.write_all(b"(")?;
                for x in t.iter() {
                    self.value(x)?;
                }
                self.out.write_all(b"t")
            }
            Value::Dict(d) => {
                let id = Rc::as_ptr(d) as *const u8 as usize;
                if self.recall(id)? {
                    return Ok(());
                }
                self.out.write_all(b"}")?;
                self.memoize(id)?;
                for chunk in d.borrow().chunks(1000) {
                    self.out.write_all(b"(")?;
                    for (k, x) in chunk {
                        self.value(k)?;
                        self.value(x)?;
                    }
                    self.out.write_all(b"u")?;
                }
                Ok(())
            }
        }
    }
}

/// The identity of a container value (the address of its shared cell).
pub fn container(v: &Value) -> Option<usize> {
    match v {
        Value::List(l) => Some(Rc::as_ptr(l) as *const u8 as usize),
        Value::Dict(d) => Some(Rc::as_ptr(d) as *const u8 as usize),
        Value::Tuple(t) => Some(Rc::as_ptr(t) as *const u8 as usize),
        _ => None,
    }
}

/// Appends `items` to `list`, through the hook.
fn append(list: &Rc<RefCell<Vec<Value>>>, items: impl Iterator<Item = Value>, hook: Hook<'_>) -> Result<(), String> {
    let id = Rc::as_ptr(list) as *const u8 as usize;
    let mut l = list.borrow_mut();
    for v in items {
        if container(&v) == Some(id) {
            return Err("a list appended to itself (a cycle)".into());
        }
        if let Some(v) = hook(id, v)? {
            l.push(v);
        }
    }
    Ok(())
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
        let p = [
            0x80, 4, b']', 0x94, b']', 0x94, b'K', 1, b'a', b'a', b'h', 1, b'a', b']', 0x94, b'K', 5, b'a', b'a', b'.',
        ];
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
