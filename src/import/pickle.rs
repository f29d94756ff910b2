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

/// Most values on the unpickler's stack at once. A pickler puts at most
/// a batch of 1 000 items per open container there (APPENDS, SETITEMS),
/// so a snapshot holds a few thousand; a file that pushes millions of
/// values without building anything of them (100 MiB of NONE opcodes took
/// 3.2 GB) is refused before it takes the machine's memory.
pub const MAX_STACK: usize = 10_000_000;

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
    #[error(
        "pickle holds more than {MAX_STACK} values on its stack at byte {offset} (a snapshot holds a few thousand): \
         not a snapshot"
    )]
    TooManyValues { offset: usize },
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
        b'B' => "BINBYTES",
        b'C' => "SHORT_BINBYTES",
        0x8e => "BINBYTES8",
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
        if stack.len() > MAX_STACK {
            return Err(PickleError::TooManyValues { offset: at });
        }
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
mod tests;
