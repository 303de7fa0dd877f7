from flexsearch.console import entry

entry()
