"""Commands with a module of their own (each registered in cli.py with one line); none imports cli.py."""
