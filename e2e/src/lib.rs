#![forbid(unsafe_code)]

pub mod cluster;
pub mod kstatus;
pub mod kubelet;
pub mod node;
pub mod scale;
