-- noop: the baseline for the acquire benchmark: one EVALSHA that does nothing.
return 0
