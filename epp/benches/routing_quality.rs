//! Routing quality on the simulator (work in progress).
fn main() {}
