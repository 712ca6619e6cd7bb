#![forbid(unsafe_code)]

pub mod cluster;
pub mod kubelet;
pub mod node;
pub mod scale;
