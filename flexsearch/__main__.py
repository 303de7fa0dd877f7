from flexsearch.cli import entry

entry()
