"""What a user types and sees: the CLI, config headers, one-line errors, estimates, plots, the run summary."""
