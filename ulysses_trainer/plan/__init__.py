"""Memory planner: predict peaks before launch, choose the cheapest settings that fit."""
