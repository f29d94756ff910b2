//! Where a virtual address of an ELF file lies in the file: what a uprobe
//! is attached at (`record` attaches by file offset, not by name).

use object::{Object, ObjectSegment};

/// The loadable segments of a file: (address, size in the file, offset).
pub(super) struct FileOffsets(Vec<(u64, u64, u64)>);

impl FileOffsets {
    pub(super) fn of(file: &object::File<'_>) -> FileOffsets {
        FileOffsets(file.segments().map(|s| (s.address(), s.file_range().1, s.file_range().0)).collect())
    }

    /// The file offset of `addr`, through the segment that holds it.
    pub(super) fn at(&self, addr: u64) -> Option<usize> {
        self.0
            .iter()
            .find(|&&(at, size, _)| addr >= at && addr < at + size)
            .and_then(|&(at, _, file_at)| usize::try_from(addr - at + file_at).ok())
    }
}

/// Where a library calls an imported function: the function's PLT stub
/// (`call stub`) and its GOT slot (`call *slot(%rip)`, built with
/// `-fno-plt`). The dynamic relocations name the slot; the stubs in `.plt`
/// and `.plt.sec` jump through it (`jmp *slot(%rip)`), one per 16 bytes.
/// x86-64 only. Neither is found for a name the file does not import.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Import {
    pub stub: Option<u64>,
    /// Every GOT slot a dynamic relocation fills with its address (a
    /// `JUMP_SLOT` for the PLT, a `GLOB_DAT` for `-fno-plt` calls).
    pub slots: Vec<u64>,
}

impl Import {
    /// The import of `name` (its mangled name) in `file`.
    pub(super) fn of(file: &object::File<'_>, name: &str) -> Import {
        use iced_x86::{Decoder, DecoderOptions, Mnemonic};
        use object::{ObjectSection, ObjectSymbol, ObjectSymbolTable, RelocationTarget};
        let Some(symbols) = file.dynamic_symbol_table() else { return Import::default() };
        let slots: Vec<u64> = file
            .dynamic_relocations()
            .into_iter()
            .flatten()
            .filter_map(|(at, r)| match r.target() {
                RelocationTarget::Symbol(i) if symbols.symbol_by_index(i).ok()?.name().ok()? == name => Some(at),
                _ => None,
            })
            .collect();
        let stub = (!slots.is_empty())
            .then(|| {
                file.sections().filter(|s| matches!(s.name(), Ok(".plt" | ".plt.sec"))).find_map(|s| {
                    let code = s.data().ok()?;
                    let mut d = Decoder::with_ip(64, code, s.address(), DecoderOptions::NONE);
                    std::iter::from_fn(|| d.can_decode().then(|| d.decode())).find_map(|ins| {
                        (ins.mnemonic() == Mnemonic::Jmp
                            && ins.is_ip_rel_memory_operand()
                            && slots.contains(&ins.ip_rel_memory_address()))
                        .then(|| s.address() + (ins.ip() - s.address()) / 16 * 16)
                    })
                })
            })
            .flatten();
        Import { stub, slots }
    }

    /// Whether `ins` calls the import.
    pub(super) fn called_by(&self, ins: &iced_x86::Instruction) -> bool {
        use iced_x86::{Mnemonic, OpKind};
        if ins.mnemonic() != Mnemonic::Call {
            return false;
        }
        if ins.op0_kind() == OpKind::NearBranch64 {
            return self.stub == Some(ins.near_branch_target());
        }
        ins.is_ip_rel_memory_operand() && self.slots.contains(&ins.ip_rel_memory_address())
    }
}

/// `endbr64`: the landing pad that code built for Intel CET
/// (`-fcf-protection`, the default of Ubuntu's GCC since 19.10 and of
/// Fedora's packages) puts at the start of every function that may be
/// called indirectly.
const ENDBR64: [u8; 4] = [0xf3, 0x0f, 0x1e, 0xfa];

/// Where a probe on the entry of the function at `addr` goes (`code`, its
/// bytes): past a leading `endbr64`, unless the function jumps back to the
/// instruction after it (a loop at its top), else at `addr`.
///
/// The kernel emulates a probed `push`, `call`, `jmp` or `nop`, but steps
/// any other instruction out of line, which is a second trap: on this
/// project's VM (Linux 6.18) 9.8 µs a hit on `endbr64` against 0.62 µs on
/// a `push` (docs/recording.md, "Libraries built for Intel CET"). `endbr64` changes no
/// register and no memory, so a probe after it reads the same arguments,
/// stack pointer and return address; a uretprobe there takes the same
/// return address. x86-64 only.
pub(super) fn entry_probe_at(code: &[u8], addr: u64) -> u64 {
    use iced_x86::{Decoder, DecoderOptions};
    if !code.starts_with(&ENDBR64) || code.len() <= ENDBR64.len() {
        return addr;
    }
    let after = addr + ENDBR64.len() as u64;
    let mut d = Decoder::with_ip(64, code, addr, DecoderOptions::NONE);
    // Any direct call, jump or conditional jump (0 for other instructions).
    let jumped_to = std::iter::from_fn(|| d.can_decode().then(|| d.decode())).any(|i| i.near_branch_target() == after);
    if jumped_to { addr } else { after }
}

/// How many instructions after a call [`return_probe_at`] looks through.
const RETURN_PROBE_REACH: usize = 4;

/// Where the probe for a call's return goes (`code`, the bytes of the
/// function at `start`; `landing`, the instruction after the call): the
/// first direct `jmp` or `jcc` from `landing` on, which the kernel
/// emulates, when it is at most [`RETURN_PROBE_REACH`] instructions on in
/// straight-line code: no instruction after `landing` up to it is the
/// target of a jump (`jump_targets`), and those before it only write
/// registers other than the stack pointer (`mov`, `movzx`, `lea`,
/// arithmetic into a register) or flags (`test`, `cmp`). It is then reached exactly when the call returns, with
/// the memory the call wrote as it was, and costs one trap instead of two:
/// the kernel steps any other instruction out of line (9.4 µs a hit against
/// 0.6 µs on this project's VM). Else `landing`. (Not a `call` or a `nop`,
/// which the kernel emulates too: other probes sit on calls and on
/// PyTorch's static probe's `nop`, and a return probe must not share one.)
pub(super) fn return_probe_at(
    code: &[u8],
    start: u64,
    landing: u64,
    jump_targets: &std::collections::HashSet<u64>,
) -> u64 {
    use iced_x86::{Decoder, DecoderOptions, Mnemonic as M, OpKind};
    let Some(from) = landing.checked_sub(start).and_then(|o| usize::try_from(o).ok()).filter(|&o| o < code.len())
    else {
        return landing;
    };
    let mut d = Decoder::with_ip(64, &code[from..], landing, DecoderOptions::NONE);
    for _ in 0..RETURN_PROBE_REACH {
        if !d.can_decode() {
            break;
        }
        let ins = d.decode();
        if ins.ip() != landing && jump_targets.contains(&ins.ip()) {
            break;
        }
        let jump = matches!(
            ins.mnemonic(),
            M::Jmp
                | M::Jo
                | M::Jno
                | M::Jb
                | M::Jae
                | M::Je
                | M::Jne
                | M::Jbe
                | M::Ja
                | M::Js
                | M::Jns
                | M::Jp
                | M::Jnp
                | M::Jl
                | M::Jge
                | M::Jle
                | M::Jg
        );
        if jump && ins.op0_kind() == OpKind::NearBranch64 {
            return ins.ip();
        }
        // Not the stack pointer: the slot the call wrote may lie below a
        // raised one, where a signal frame can overwrite it.
        let into_register = ins.op_count() > 0
            && ins.op0_kind() == OpKind::Register
            && !matches!(ins.op0_register(), iced_x86::Register::RSP | iced_x86::Register::ESP);
        let harmless = match ins.mnemonic() {
            M::Test | M::Cmp => true,
            M::Mov | M::Movzx | M::Movsx | M::Movsxd | M::Lea | M::Xor | M::Add | M::Sub | M::And | M::Or => {
                into_register
            }
            _ => false,
        };
        if !harmless {
            break;
        }
    }
    landing
}

#[cfg(test)]
mod tests {
    use super::{entry_probe_at, return_probe_at};

    #[test]
    fn an_entry_probe_goes_after_endbr64_unless_a_jump_lands_there() {
        let at = 0x1000;
        // endbr64; push %rbp; ret
        assert_eq!(entry_probe_at(&[0xf3, 0x0f, 0x1e, 0xfa, 0x55, 0xc3], at), at + 4);
        // push %rbp; ret: no landing pad.
        assert_eq!(entry_probe_at(&[0x55, 0xc3], at), at);
        // endbr64; dec %rdi; jne (back to the dec): a loop at the top, whose
        // every turn a probe after endbr64 would take for a call.
        let looped = [0xf3, 0x0f, 0x1e, 0xfa, 0x48, 0xff, 0xcf, 0x75, 0xfb, 0xc3];
        assert_eq!(entry_probe_at(&looped, at), at);
        // The same jump elsewhere (to the ret) does not.
        let forward = [0xf3, 0x0f, 0x1e, 0xfa, 0x48, 0xff, 0xcf, 0x75, 0x00, 0xc3];
        assert_eq!(entry_probe_at(&forward, at), at + 4);
        // endbr64 alone (a function of unknown size): nothing after it.
        assert_eq!(entry_probe_at(&[0xf3, 0x0f, 0x1e, 0xfa], at), at);
    }

    #[test]
    fn a_return_probe_goes_on_a_jump_soon_after_the_call_in_straight_line_code() {
        use std::collections::HashSet;
        let at = 0x1000;
        let none = HashSet::new();
        // mov -0x28(%rbp),%rax; test %rax,%rax; je +2; ret; ret
        let checked = [0x48, 0x8b, 0x45, 0xd8, 0x48, 0x85, 0xc0, 0x74, 0x02, 0xc3, 0xc3];
        assert_eq!(return_probe_at(&checked, at, at, &none), at + 7);
        // The same seen from a landing inside the function.
        let mut code = vec![0x90, 0x90];
        code.extend(checked);
        assert_eq!(return_probe_at(&code, at, at + 2, &none), at + 9);
        // Something jumps to the test: a probe on the je would fire for it too.
        assert_eq!(return_probe_at(&checked, at, at, &HashSet::from([at + 4])), at);
        // A jump to the landing itself is the caller's concern (the plan refuses it).
        assert_eq!(return_probe_at(&checked, at, at, &HashSet::from([at])), at + 7);
        // The stack pointer raised before the jump.
        assert_eq!(return_probe_at(&[0x48, 0x83, 0xc4, 0x28, 0xeb, 0x00, 0xc3], at, at, &none), at);
        // A store before the jump: the memory the call wrote may change.
        let store = [0x48, 0x89, 0x45, 0xd8, 0xeb, 0x00, 0xc3];
        assert_eq!(return_probe_at(&store, at, at, &none), at);
        // mov -0x8(%rbp),%rax; leave; ret: no jump before the return.
        assert_eq!(return_probe_at(&[0x48, 0x8b, 0x45, 0xf8, 0xc9, 0xc3], at, at, &none), at);
        // The jump already there: the landing.
        assert_eq!(return_probe_at(&[0xeb, 0x00, 0xc3], at, at, &none), at);
        // Too far: four register moves, then the jump.
        let far = [0x48, 0x89, 0xc1, 0x48, 0x89, 0xc1, 0x48, 0x89, 0xc1, 0x48, 0x89, 0xc1, 0xeb, 0x00, 0xc3];
        assert_eq!(return_probe_at(&far, at, at, &none), at);
        assert_eq!(return_probe_at(&far[3..], at, at, &none), at + 9);
        // A call after the register moves is not taken (other probes sit on calls).
        assert_eq!(return_probe_at(&[0x48, 0x89, 0xc1, 0xe8, 0, 0, 0, 0, 0xc3], at, at, &none), at);
    }
}
