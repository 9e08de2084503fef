//! Writes the seed corpora: `cargo run --manifest-path fuzz/Cargo.toml --no-default-features
//! --example seeds -- <dir>` creates `<dir>/frame_decode/*`, `<dir>/handshake/*` and
//! `<dir>/verbs_bootstrap/*`.
use std::path::PathBuf;

fn main() -> std::io::Result<()> {
    let root = PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| "fuzz/corpus".into()));
    for (target, seeds) in [
        ("frame_decode", wire_fuzz::seeds::frame_decode()),
        ("handshake", wire_fuzz::seeds::handshake()),
        ("verbs_bootstrap", wire_fuzz::verbs_bootstrap::seeds()),
    ] {
        let dir = root.join(target);
        std::fs::create_dir_all(&dir)?;
        for (name, bytes) in &seeds {
            std::fs::write(dir.join(format!("seed-{name}")), bytes)?;
        }
        println!("{}: {} seeds", dir.display(), seeds.len());
    }
    Ok(())
}
