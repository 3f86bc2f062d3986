"""The test suite: a package so that its helpers import as `tests.support` (pytest puts the folder
above it on sys.path). Test folders are not packages; test file names are unique across them."""
