# kvtier-inspect census on the real configs in ../shared/models: byte counts of DESIGN.md
# section 1 in the text and --json forms, and a non-zero exit for a missing file and a bad flag.
if(TARGET kvtier-inspect)
  set(KVT_MODELS ${PROJECT_SOURCE_DIR}/../shared/models)
  set(KVT_KIMI ${KVT_MODELS}/kimi-linear-48b-a3b-instruct.json)
  set(KVT_DSV3 ${KVT_MODELS}/deepseek-v3.json)

  add_test(NAME inspect_census_kimi
    COMMAND $<TARGET_FILE:kvtier-inspect> census ${KVT_KIMI} --ratio 32)
  set_tests_properties(inspect_census_kimi PROPERTIES PASS_REGULAR_EXPRESSION
    "26 +mla-nope +576 x bf16 = 1152 B +policy salience\nkv bytes per token: 8,064 B/token.*dense cache +264,241,152 B.*~252 B/token")

  add_test(NAME inspect_census_kimi_1_indexed
    COMMAND $<TARGET_FILE:kvtier-inspect> census ${KVT_KIMI})
  set_tests_properties(inspect_census_kimi_1_indexed PROPERTIES PASS_REGULAR_EXPRESSION
    "0-2 +no-kv +\\(KDA\\) +policy none\n +3 +mla-nope")

  add_test(NAME inspect_census_kimi_concurrency
    COMMAND $<TARGET_FILE:kvtier-inspect> census ${KVT_KIMI} --context 32768 --concurrency 32)
  set_tests_properties(inspect_census_kimi_concurrency PROPERTIES PASS_REGULAR_EXPRESSION
    "dense cache +8,455,716,864 B \\(8\\.5 GB\\)")

  add_test(NAME inspect_census_deepseek
    COMMAND $<TARGET_FILE:kvtier-inspect> census ${KVT_DSV3})
  set_tests_properties(inspect_census_deepseek PROPERTIES PASS_REGULAR_EXPRESSION
    "0-60 +mla-rope +576 x bf16 = 1152 B +policy random-evict.*kv bytes per token: 70,272 B/token")

  add_test(NAME inspect_census_deepseek_fp32
    COMMAND $<TARGET_FILE:kvtier-inspect> census ${KVT_DSV3} --dtype fp32)
  set_tests_properties(inspect_census_deepseek_fp32 PROPERTIES PASS_REGULAR_EXPRESSION
    "kv bytes per token: 140,544 B/token")

  add_test(NAME inspect_census_kimi_json
    COMMAND $<TARGET_FILE:kvtier-inspect> census ${KVT_KIMI} --json --ratio 32)
  set_tests_properties(inspect_census_kimi_json PROPERTIES PASS_REGULAR_EXPRESSION
    "\"kv_bytes_per_token\": 8064,.*\"index\": 3,\n +\"kind\": \"mla-nope\",\n +\"policy\": \"salience\".*\"dense_bytes\": 264241152,\n +\"attended_bytes\": 8257536,\n +\"freed_bytes\": 0")

  add_test(NAME inspect_census_deepseek_json
    COMMAND $<TARGET_FILE:kvtier-inspect> census ${KVT_DSV3} --json)
  set_tests_properties(inspect_census_deepseek_json PROPERTIES PASS_REGULAR_EXPRESSION
    "\"kv_bytes_per_token\": 70272,.*\"index\": 60,\n +\"kind\": \"mla-rope\",\n +\"policy\": \"random-evict\"")

  # Failures: non-zero exit (WILL_FAIL) and a one-line error naming the problem.
  add_test(NAME inspect_census_missing_file
    COMMAND $<TARGET_FILE:kvtier-inspect> census ${KVT_MODELS}/no-such-config.json)
  set_tests_properties(inspect_census_missing_file PROPERTIES WILL_FAIL TRUE)
  add_test(NAME inspect_census_missing_file_message
    COMMAND ${CMAKE_COMMAND} -E env $<TARGET_FILE:kvtier-inspect> census ${KVT_MODELS}/no-such-config.json)
  set_tests_properties(inspect_census_missing_file_message PROPERTIES
    PASS_REGULAR_EXPRESSION "kvtier-inspect census: .*no-such-config.json: cannot open")

  add_test(NAME inspect_census_bad_flag
    COMMAND $<TARGET_FILE:kvtier-inspect> census ${KVT_KIMI} --frobnicate)
  set_tests_properties(inspect_census_bad_flag PROPERTIES WILL_FAIL TRUE)
  add_test(NAME inspect_census_bad_ratio
    COMMAND $<TARGET_FILE:kvtier-inspect> census ${KVT_KIMI} --ratio 0.5)
  set_tests_properties(inspect_census_bad_ratio PROPERTIES WILL_FAIL TRUE)
  add_test(NAME inspect_census_bad_dtype
    COMMAND $<TARGET_FILE:kvtier-inspect> census ${KVT_KIMI} --dtype int4)
  set_tests_properties(inspect_census_bad_dtype PROPERTIES WILL_FAIL TRUE)
  add_test(NAME inspect_unknown_command
    COMMAND $<TARGET_FILE:kvtier-inspect> frobnicate)
  set_tests_properties(inspect_unknown_command PROPERTIES WILL_FAIL TRUE)
endif()
