from kvq.cli import entry

entry()
