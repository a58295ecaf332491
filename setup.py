"""pyproject.toml describes the project; this adds one file to its wheels: 00-ulysses_trainer-runner.pth, at the top
of site-packages. Python's `site` runs its one line at the start of every interpreter of the environment, before the
program and before the other .pth files (an editable install's import hook among them: the name sorts first). Unless
the command line names deepspeed the line does nothing; then it runs ulysses_trainer/cli/deepspeed_hook.py (found
as an import would find it, without importing the package) and calls its guard_start, which acts only in the
`deepspeed` command's runner launching this trainer: a Ctrl-C before torch is imported says one line, exit 130."""

from __future__ import annotations

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH_NAME = "00-ulysses_trainer-runner.pth"
_CHECKOUT = os.path.dirname(os.path.abspath(__file__))
_HOOK = ("ulysses_trainer", "cli", "deepspeed_hook.py")
# site runs a line that starts with `import`; the try: a broken or moved install never breaks a program's start
_CODE = """try:
 import os, sys
 for d in [*sys.path, {checkout!r}]:
  f = os.path.join(d or '', *{hook!r})
  if d is not None and os.path.isfile(f):
   m = type(sys)('ulysses_trainer.cli.deepspeed_hook')
   m.__file__ = f
   with open(f, encoding='utf-8') as h:
    code = compile(h.read(), f, 'exec')
   exec(code, m.__dict__)
   m.guard_start() and sys.modules.setdefault(m.__name__, m)
   break
except Exception:
 pass
"""


def pth_line(checkout: str | None) -> str:
    """The .pth file's line; `checkout`: where an editable install's package lies (not on sys.path at start-up)."""
    return f"import sys; exec({_CODE.format(checkout=checkout, hook=_HOOK)!r}, {{}}) " \
           "if 'deepspeed' in ' '.join(sys.orig_argv) else None\n"


class BuildPyWithPth(build_py):
    """build_py, plus the .pth file at the wheel's top folder (site-packages once installed)."""

    def run(self) -> None:
        super().run()
        top, checkout = self.build_lib, None
        if self._editable():  # an editable wheel is packed from install_lib, not build_lib
            top, checkout = self.get_finalized_command("install").install_lib, _CHECKOUT
        os.makedirs(top, exist_ok=True)
        with open(os.path.join(top, PTH_NAME), "w", encoding="utf-8") as f:
            f.write(pth_line(checkout))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        extra = [] if self._editable() else [os.path.join(self.build_lib, PTH_NAME)]
        return [*super().get_outputs(include_bytecode), *extra]

    def _editable(self) -> bool:
        return bool(getattr(self, "editable_mode", False))


setup(cmdclass={"build_py": BuildPyWithPth})
