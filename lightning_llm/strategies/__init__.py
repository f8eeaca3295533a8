"""Parallel strategies, registered in Lightning's StrategyRegistry on import."""
