"""The command line: one typer app, its subcommands, output folders, progress and messages."""
