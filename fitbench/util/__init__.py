"""What every floor may use and none owns: the user's error (``errors``), units (``units``), statistics
of a sample (``stats``), JSON a person may have edited (``jsonfile``), a server's address
(``endpoints``), the cache directory (``cache``), host memory (``host``), process trees (``processes``)
and fault injection for tests (``inject``). Nothing here imports the rest of fitbench."""
