//! One chunk of one parameter as every host kernel takes it (the chunked driver in
//! `host` and the fused `fast` kernel alike), so neither depends on the other for it.
use crate::optim::math::rule::Rule;
use crate::optim::math::state::{GradChunk, MomentChunk, ParamChunk};

/// One chunk of one parameter with everything its update touches.
pub struct Job<'a> {
    pub p: ParamChunk<'a>,
    pub g: GradChunk<'a>,
    pub m: Option<MomentChunk<'a>>,
    pub v: Option<MomentChunk<'a>>,
    pub rule: Rule,
    pub first: bool,
}
