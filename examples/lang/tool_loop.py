"""A tool-using loop: the model picks a tool (constrained choice), writes its argument (a
regex-constrained gen), the program runs the tool and feeds the result back, until the model
picks "finish".

    tokenmill serve smollm2-135m-instruct --port 8000 &
    python examples/lang/tool_loop.py --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import re

from tokenmill import lang

TOOLS = {
    # the argument may end early (max_tokens), so the numbers are read, not the expression
    "calculator": lambda arg: str(sum(int(x) for x in re.findall(r"[0-9]+", arg))),
    "lookup": lambda arg: {"france": "Paris", "italy": "Rome"}.get(arg.strip().lower(), "?"),
}


@lang.function
def agent(s, task: str, max_steps: int = 3) -> None:
    s += (f"Task: {task}\nTools: calculator (adds numbers like 2+3), lookup (a country's "
          f"capital), finish.\n")
    for step in range(max_steps):
        s += f"Step {step + 1}. Tool:"
        s += lang.select(f"tool{step}", [" calculator", " lookup", " finish"], method="choice")
        tool = s[f"tool{step}"].strip()
        if tool == "finish":
            break
        s += " Input:"
        s += lang.gen(f"arg{step}", max_tokens=12, temperature=0,
                      regex=r" [0-9]+(\+[0-9]+)*" if tool == "calculator" else r" [A-Za-z]+")
        s += f"\nResult: {TOOLS[tool](s[f'arg{step}'])}\n"
    s += "Final answer:"
    s += lang.gen("answer", max_tokens=16, temperature=0, stop="\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    args = parser.parse_args()
    state = agent.run(task="What is 17+25?", backend=lang.Endpoint(args.url))
    print(state.text())


if __name__ == "__main__":
    main()
