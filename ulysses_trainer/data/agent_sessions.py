"""Deterministic synthetic agent sessions: long multi-turn tool use whose results are needed many turns later.

Each session is a conversation (TRL's `messages` + `tools`): a system prompt, a user task ("audit
the services, then answer questions about them"), then turn after turn of the assistant thinking,
calling a tool (read a config file, run a command, grep) and reading a long tool result. Config
files state facts (a service's port and owner) once; later the user asks for facts read many turns
and thousands of tokens earlier, and the assistant answers them. With assistant_only_loss the
answers are trained while the tool output is not, so the loss can fall only if attention reaches
back to the tool result. No network, no third-party text: everything derives from one seed.
`agent_sessions` makes sessions of about max_length tokens (one per sequence); `mixed_agent_sessions`
makes sessions of mixed lengths (4K-400K tokens, median 60K), the case packing is for.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator

from .synthetic import _name, _sentence

TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file of the workspace.",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                     "required": ["path"]}}},
    {"type": "function", "function": {"name": "run", "description": "Run a shell command; returns its output.",
                                      "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                                                     "required": ["command"]}}},
]
_CHARS_PER_TOKEN = 3.2  # of these sessions rendered, under the Qwen BPE (measured: tests/test_conversations.py)


def _call(name: str, **args: str) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def _config_file(rng: random.Random, service: str, port: int, owner: str, lines: int) -> str:
    body = [f"# {service} service configuration", "[service]", f"name = {service.lower()}"]
    facts = [f"port = {port}", f"owner = {owner}"]
    for i in range(lines):
        if facts and rng.random() < 2 / max(lines - i, 1):
            body.append(facts.pop(0))
        else:
            key = rng.choice(["timeout", "retries", "workers", "buffer", "level"])
            body.append(f"; {_sentence(rng)}" if rng.random() < 0.5 else f"{key}_{i} = {rng.randint(1, 999)}")
    return "\n".join(body + facts)


def _log_output(rng: random.Random, lines: int) -> str:
    return "\n".join(f"[{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}] "
                     f"{rng.choice(['INFO', 'WARN', 'DEBUG'])} {_sentence(rng)}" for _ in range(lines))


def agent_session(rng: random.Random, target_chars: int) -> list[dict]:
    """One session of about target_chars characters of message text."""
    msgs = [{"role": "system", "content": "You are a careful operations agent working in a server workspace. "
                                          "Use the tools to inspect files; answer from what you have read."},
            {"role": "user", "content": "Audit every service under services/: read each config file and keep track "
                                        "of its port and owner. I will ask about them as you go."}]
    seen: list[tuple[str, int, str]] = []
    size = sum(len(m["content"]) for m in msgs) + 900  # + the tools block of the system turn
    lines = max(4, min(400, target_chars // 1200))  # tool results of a few hundred to ~10K tokens
    while size < target_chars:
        r = rng.random()
        if seen and r < 0.25:  # a question about a file read turns ago: the answer needs that tool result
            service, port, owner = rng.choice(seen[:max(1, len(seen) - 2)])
            what = rng.choice(["port", "owner"])
            value = port if what == "port" else owner
            turn = [{"role": "user", "content": f"What is the {what} of {service}?"},
                    {"role": "assistant", "reasoning_content": f"I read services/{service}.conf earlier; its {what} "
                     f"line gives it.", "content": f"The {what} of {service} is {value}."}]
        elif r < 0.8:
            service, port, owner = _name(rng), rng.randint(1024, 65535), _name(rng)
            seen.append((service, port, owner))
            path = f"services/{service}.conf"
            turn = [{"role": "assistant", "reasoning_content": f"Next, {path}.", "content": "",
                     "tool_calls": [_call("read_file", path=path)]},
                    {"role": "tool", "content": _config_file(rng, service, port, owner, lines)}]
        else:
            cmd = rng.choice(["journalctl -n 200", "tail -n 200 /var/log/syslog", "dmesg | tail -n 200"])
            turn = [{"role": "assistant", "content": "Checking the recent log for errors.",
                     "tool_calls": [_call("run", command=cmd)]},
                    {"role": "tool", "content": _log_output(rng, lines)},
                    {"role": "assistant", "content": "Nothing in the log concerns the services so far."}]
        msgs += turn
        size += sum(len(m.get("content") or "") + len(m.get("reasoning_content") or "") + 80 for m in turn)
    summary = "; ".join(f"{s}: port {p}, owner {o}" for s, p, o in seen)
    msgs += [{"role": "user", "content": "Summarise every service you audited."},
             {"role": "assistant", "content": f"Services audited: {summary}." if seen else "No service was read."}]
    return msgs


def agent_sessions(seed: int, mean_tokens: int) -> Iterator[dict]:
    """An endless deterministic stream of {"messages", "tools"} sessions of 0.6-0.95 x mean_tokens tokens."""
    rng = random.Random(seed)
    while True:
        target = int(mean_tokens * rng.uniform(0.6, 0.95) * _CHARS_PER_TOKEN)
        yield {"messages": agent_session(rng, target), "tools": TOOLS}


# Mixed lengths, as real agent logs come: log-normal session lengths, median 60K tokens, sigma 1.0 (the
# longest ~3% would pass 400K), kept to 4K-400K tokens by drawing again outside that range.
MIXED_MEDIAN_TOKENS, MIXED_SIGMA = 60_000, 1.0
MIXED_MIN_TOKENS, MIXED_MAX_TOKENS = 4_096, 409_600


def mixed_session_tokens(rng: random.Random) -> int:
    """One session's target length in tokens, from the heavy-tailed mixed distribution."""
    while True:
        n = int(rng.lognormvariate(math.log(MIXED_MEDIAN_TOKENS), MIXED_SIGMA))
        if MIXED_MIN_TOKENS <= n <= MIXED_MAX_TOKENS:
            return n


def mixed_agent_sessions(seed: int) -> Iterator[dict]:
    """An endless deterministic stream of {"messages", "tools"} sessions of mixed lengths (mixed_session_tokens)."""
    rng = random.Random(seed)
    while True:
        yield {"messages": agent_session(rng, int(mixed_session_tokens(rng) * _CHARS_PER_TOKEN)), "tools": TOOLS}
