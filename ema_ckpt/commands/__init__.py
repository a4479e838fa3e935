"""One module per command: its options, its job for the runner, and its library function."""
