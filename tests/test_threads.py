"""ThreadGovernor on made-up clocks: the share of a core the forward's thread gets decides the
thread count."""

from __future__ import annotations

from tokenmill.runner.threads import GovernorLimits, ThreadGovernor


class Clocks:
    """Each forward advances wall time by ``step`` and the thread's CPU time by ``share`` of it."""

    def __init__(self):
        self.wall = self.cpu = 0.0
        self.share = 1.0
        self.set_to: list[int] = []

    def forward(self, step: float = 0.05):
        def run():
            self.wall += step
            self.cpu += step * self.share
            return "logits"
        return run


def governor(clocks: Clocks, threads: int = 2) -> ThreadGovernor:
    return ThreadGovernor(threads, GovernorLimits(window_s=0.5, contended_below=0.8,
                                                  retry_after_s=4.0),
                          wall=lambda: clocks.wall, cpu=lambda: clocks.cpu,
                          set_threads=clocks.set_to.append)


def run_for(g: ThreadGovernor, clocks: Clocks, seconds: float) -> None:
    for _ in range(round(seconds / 0.05)):
        assert g.run(clocks.forward()) == "logits"


def test_alone_the_full_count_stays():
    clocks = Clocks()
    g = governor(clocks)
    run_for(g, clocks, 30)
    assert g.threads == 2 and clocks.set_to == []


def test_beside_busy_neighbours_one_thread_with_a_retry_every_few_seconds():
    clocks = Clocks()
    g = governor(clocks)
    clocks.share = 0.5  # two threads, each half a core
    run_for(g, clocks, 0.55)
    assert g.threads == 1 and clocks.set_to == [1]
    clocks.share = 0.67  # one thread beside two busy loops: still below the bar
    run_for(g, clocks, 3.5)
    assert clocks.set_to == [1]  # no retry before retry_after_s
    run_for(g, clocks, 1.2)
    assert clocks.set_to == [1, 2]  # the retry
    clocks.share = 0.5
    run_for(g, clocks, 0.55)
    assert clocks.set_to == [1, 2, 1] and g.threads == 1  # still contended: back to one


def test_when_the_neighbours_leave_the_retry_keeps_the_full_count():
    clocks = Clocks()
    g = governor(clocks)
    clocks.share = 0.5
    run_for(g, clocks, 0.55)
    clocks.share = 1.0  # the cores are free again
    run_for(g, clocks, 5)
    assert g.threads == 2
    run_for(g, clocks, 10)
    assert clocks.set_to == [1, 2]


def test_a_single_thread_is_never_changed():
    clocks = Clocks()
    g = governor(clocks, threads=1)
    clocks.share = 0.3
    run_for(g, clocks, 20)
    assert clocks.set_to == [] and g.threads == 1
