"""The generic passes, each a pure function Kernel -> Kernel over a target's sync model:
plan_smem, insert_barriers, verify; and the async model (asyncmodel/) that sm_90a's verify
proves its plans in."""
