//! Builds the operator, EPP and simulator images without docker: OCI image
//! archives of the `dist` binaries (stripped release builds) with what the
//! Dockerfiles' distroless runtime stage provides, run as nonroot. Load them
//! with `kind load image-archive`, `ctr -n k8s.io images import`,
//! `podman load` or `skopeo copy oci-archive:...`.
//!
//!   cargo run -p kinference-e2e --bin kinference-images -- --out dist/images

use std::path::PathBuf;

use anyhow::Result;
use clap::Parser;
use kinference_e2e::node::workspace_images::{self, ALL};

#[derive(Parser)]
struct Args {
    /// Where to write `<binary>.oci.tar`.
    #[arg(long, default_value = "dist/images")]
    out: PathBuf,
    /// Take the binaries from here instead of `cargo build --profile dist`
    /// (they are stripped on the way in).
    #[arg(long)]
    bin_dir: Option<PathBuf>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let bins = match args.bin_dir {
        Some(dir) => dir,
        None => workspace_images::image_binaries()?,
    };
    std::fs::create_dir_all(&args.out)?;
    for ((archive, digests), image) in workspace_images::write_archives(&bins, &args.out)?
        .into_iter()
        .zip(ALL)
    {
        let size = std::fs::metadata(&archive)?.len();
        println!(
            "{}\t{}\t{:.1} MB\t{}",
            archive.display(),
            image.reference,
            size as f64 / 1e6,
            digests.manifest
        );
    }
    Ok(())
}
