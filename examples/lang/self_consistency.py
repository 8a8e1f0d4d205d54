"""Self-consistency: sample several reasoning paths from one shared question (fork: the question
is computed once), then take the majority answer.

    tokenmill serve smollm2-135m-instruct --port 8000 &
    python examples/lang/self_consistency.py --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
from collections import Counter

from tokenmill import lang


@lang.function
def vote(s, question: str, paths: int, reasoning_tokens: int = 64) -> None:
    s += f"Question: {question}\nThink step by step, then give the answer after 'Answer:'.\n"
    forks = s.fork(paths)
    forks += lang.gen("reasoning", max_tokens=reasoning_tokens, temperature=0.8, stop="Answer:")
    forks += "Answer:"
    forks += lang.gen("answer", max_tokens=8, temperature=0, stop="\n")
    forks.join()
    answers = [f["answer"].strip() for f in forks]
    s.set_var("answers", answers)
    s.set_var("majority", Counter(answers).most_common(1)[0][0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--paths", type=int, default=5)
    args = parser.parse_args()
    state = vote.run(question="What is 12 + 30?", paths=args.paths,
                     backend=lang.Endpoint(args.url))
    print("answers:", state["answers"])
    print("majority:", state["majority"])


if __name__ == "__main__":
    main()
