"""The commands: `train` (rank.py on every rank; launch/train.py in a checkout), `plan`, `rehearse`, `data`; thin
mains on one machine probe (probe.py) and one argv walk (cli/argv.py). They own argv, the environment, help text,
exit codes and the console (cli/console.py shows the library's log records). Nothing below imports them."""
