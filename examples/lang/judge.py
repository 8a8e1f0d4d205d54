"""An LLM judge that rates one answer on several criteria in parallel (one fork per criterion,
the answer computed once), each verdict a constrained choice.

    tokenmill serve smollm2-135m-instruct --port 8000 &
    python examples/lang/judge.py --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse

from tokenmill import lang

CRITERIA = ("correct", "concise", "polite")


@lang.function
def judge(s, question: str, answer: str) -> None:
    s += f"Question: {question}\nAnswer: {answer}\n"
    forks = s.fork(len(CRITERIA))
    forks += [f"Is the answer {c}? Reply yes or no:" for c in CRITERIA]
    forks += lang.select("verdict", [" yes", " no"])
    forks += lang.gen("why", max_tokens=24, temperature=0, stop="\n")
    forks.join()
    for criterion, branch in zip(CRITERIA, forks):
        s.set_var(criterion, (branch["verdict"].strip(), branch["why"].strip()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    args = parser.parse_args()
    state = judge.run(question="What is the capital of France?",
                      answer="Paris, of course.", backend=lang.Endpoint(args.url))
    for criterion in CRITERIA:
        verdict, why = state[criterion]
        print(f"{criterion:>8}: {verdict:3}  {why}")


if __name__ == "__main__":
    main()
