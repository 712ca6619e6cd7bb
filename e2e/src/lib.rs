#![forbid(unsafe_code)]

pub mod cluster;
