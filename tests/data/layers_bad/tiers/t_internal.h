/* fixture: private to tiers/ (t.c may include it, lib/c1.c may not) */
#define KVT__FIXTURE_TIER_PRIVATE 2
