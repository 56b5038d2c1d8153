"""The example specs; installed as fadsl.examples, where fadsl.attention finds the ones each
target ships (Target.shipped)."""
