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
