"""Ten development prompts, written for these tests (chat, code, math, instructions, as the
eval sets in ../shared/data/eval mix them), so that tests need no file outside the repo."""

PROMPTS = (
    "What are three good habits for staying healthy while working from home?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "A train travels 60 miles in 1.5 hours. What is its average speed in miles per hour?",
    "Explain the difference between a list and a tuple in Python.",
    "Give me a short recipe for pancakes.",
    "Summarize the water cycle in a few sentences.",
    "Tom has 12 apples and gives a third of them to Anna. How many apples does Tom have left?",
    "Write a haiku about the ocean at night.",
    "What is the capital of Australia, and why was it chosen?",
    "Describe how a binary search works.",
)
