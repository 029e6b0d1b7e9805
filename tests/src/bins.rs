//! The workspace's own binaries, as built by `cargo build --workspace --bins`
//! (`make test` builds them before running the tests).

use std::path::PathBuf;

/// The path of workspace binary `name` in this test's target profile directory.
pub fn binary(name: &str) -> PathBuf {
    // Test executables live in <target>/<profile>/deps/; binaries in <target>/<profile>/.
    let exe = std::env::current_exe().expect("current exe");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("test binaries live in <target>/<profile>/deps");
    let path = profile_dir.join(name);
    assert!(
        path.is_file(),
        "{} is not built: run `cargo build --workspace --bins` (make test does)",
        path.display()
    );
    path
}
