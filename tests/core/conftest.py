"""Hypothesis profiles: the default (100 examples per property) keeps CI fast;
`pytest tests/core --hypothesis-profile=thorough` runs 2000 per property."""

from hypothesis import settings

settings.register_profile("thorough", max_examples=2000, deadline=None)
