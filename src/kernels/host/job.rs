//! One chunk of one parameter as every host kernel takes it (the chunked driver in
//! `host` and the fused `fast` kernel alike), so neither depends on the other for it.
use crate::optim::math::rule::Rule;
use crate::optim::math::state::{GradChunk, MomentChunk, MomentView, ParamChunk};

/// One chunk of one parameter with everything its update touches.
pub struct Job<'a> {
    pub p: ParamChunk<'a>,
    pub g: GradChunk<'a>,
    pub m: Option<MomentChunk<'a>>,
    pub v: Option<MomentChunk<'a>>,
    /// `m`'s and `v`'s values before the step where they are read from another buffer
    /// than the one the step writes (`m`, `v`): the overlapped step's undo record, which
    /// so needs no copy of them. None: read in place.
    pub old: [Option<MomentView<'a>>; 2],
    pub rule: Rule,
    pub first: bool,
}
