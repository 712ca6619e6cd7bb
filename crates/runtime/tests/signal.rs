//! `shutdown_signal` resolves on SIGTERM (in its own test process: once
//! installed, the handler keeps SIGTERM from killing the process).
#![cfg(unix)]

use std::time::Duration;

#[tokio::test]
async fn sigterm_resolves_the_shutdown_signal() {
    let signal = kinference_runtime::shutdown_signal();
    let status = std::process::Command::new("kill")
        .args(["-TERM", &std::process::id().to_string()])
        .status()
        .expect("running kill");
    assert!(status.success());
    let name = tokio::time::timeout(Duration::from_secs(10), signal)
        .await
        .expect("the signal arrives");
    assert_eq!(name, "SIGTERM");
}
