/* fixture */
int kvt__fixture_tier(void);
int kvt__fixture_tier_calls_down(void);
