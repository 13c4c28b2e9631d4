"""``krex …``: the command-line interface.

In: argv.  Out: human tables on stdout (``--json`` for agents and scripts),
errors on stderr as ``krex: error: <what> (hint: <fix>)``; exit codes 0 ok,
1 error, 2 usage, 124 timeout, 127 / 126 a command not found / not executable,
otherwise the managed command's own code.
"""
