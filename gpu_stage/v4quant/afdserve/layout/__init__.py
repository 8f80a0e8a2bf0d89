"""The step layout: topology and the pure step planner. No torch and no I/O, so every other
part of afdserve can import it."""
