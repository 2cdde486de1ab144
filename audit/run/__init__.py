"""Run control: one command's flow, the scan core, and what bounds and stops a run."""
