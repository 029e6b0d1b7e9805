use clap::Parser;

fn main() {
    let cli = aether_cli::Cli::parse();
    let outcome = aether_cli::run(&cli);
    print!("{}", outcome.output);
    if let Some(error) = &outcome.error {
        eprintln!("aether: {error}");
    }
    std::process::exit(outcome.code as i32);
}
