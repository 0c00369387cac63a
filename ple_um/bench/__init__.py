"""`ple-um bench`: every lookup path this machine can run, side by side, in one table."""
