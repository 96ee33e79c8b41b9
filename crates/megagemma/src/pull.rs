//! `megagemma pull NAME`: fetch a known model into the local cache (the list and the fetching
//! live in `megagemma_engine::pull`, shared with `--model NAME`).

use anyhow::{bail, Result};
use clap::Args;
use megagemma_engine::pull::{ensure, find, KNOWN_MODELS};

#[derive(Args, Debug)]
pub struct PullArgs {
    /// Model name (see --list).
    #[arg(required_unless_present = "list")]
    pub name: Option<String>,
    /// List the models pull knows.
    #[arg(long)]
    pub list: bool,
}

pub fn pull(args: PullArgs) -> Result<()> {
    if args.list {
        for m in KNOWN_MODELS {
            println!("{:<16} {}", m.name, m.description);
        }
        return Ok(());
    }
    let name = args.name.unwrap_or_default();
    let Some(model) = find(&name) else {
        let names: Vec<_> = KNOWN_MODELS.iter().map(|m| m.name).collect();
        bail!("unknown model `{name}` (known: {})", names.join(", "));
    };
    let path = ensure(model)?;
    println!("{}", path.display());
    Ok(())
}
