//! `cadenza-torch`: the full command line (`cadenza::cli`), which the
//! libtorch-free `cadenza` binary hands every model command to.

use clap::Parser;

fn main() {
    cadenza::util::quiet_on_broken_pipe();
    let cli = cadenza::cli::Cli::parse();
    let result =
        cadenza_core::commands::init_logging(cli.verbose).and_then(|()| cadenza::cli::run(cli));
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            // Bounded and escaped: an error may quote input (crate::util::excerpt).
            let text = format!("{e:#}");
            eprintln!(
                "error: {}",
                cadenza_core::util::excerpt(&text, cadenza_core::util::MAX_ERROR_CHARS)
            );
            std::process::exit(1);
        }
    }
}
