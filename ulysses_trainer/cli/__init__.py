"""The commands: `train` (rank.py on every rank; launch/train.py in a checkout), `plan`, `rehearse`; thin mains
on one machine probe (probe.py) and one argv splitter (cli/argv.py). Nothing below imports them."""
