"""Structured outputs with llguidance: check a request's constraint when its SamplingParams
are made (grammar.py), then mask each step's tokens to the grammar (matcher.py)."""
from jaxllm.structured_output.grammar import check_structured_outputs, grammar_text
from jaxllm.structured_output.matcher import (GrammarCompiler, GrammarMatcher, apply_bitmask_numpy, bitmask_words,
                                              fill_bitmasks)

__all__ = ["check_structured_outputs", "grammar_text", "GrammarCompiler", "GrammarMatcher", "bitmask_words",
           "apply_bitmask_numpy", "fill_bitmasks"]
