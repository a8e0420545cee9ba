# The repository stands alone: no source, script, test or document of it reads the sibling
# folder `shared` beside the checkout (the model configs the tests need are in tests/data/models).
# Run as cmake -DROOT=<source dir> -P no_shared.cmake; fails naming each file that does.
set(needle "..")
string(APPEND needle "/shared")
file(GLOB_RECURSE files LIST_DIRECTORIES false
     ${ROOT}/*.c ${ROOT}/*.h ${ROOT}/*.cu ${ROOT}/*.cuh ${ROOT}/*.py ${ROOT}/*.sh
     ${ROOT}/*.cmake ${ROOT}/CMakeLists.txt ${ROOT}/*.md ${ROOT}/*.toml ${ROOT}/*.json
     ${ROOT}/.ci/*)
set(bad "")
foreach(f IN LISTS files)
  file(RELATIVE_PATH rel ${ROOT} ${f})
  if(rel MATCHES "^(build|\\.git)")
    continue()
  endif()
  file(READ ${f} text)
  string(FIND "${text}" "${needle}" at)
  if(NOT at EQUAL -1)
    list(APPEND bad ${rel})
  endif()
endforeach()
list(LENGTH files n)
if(bad)
  message(FATAL_ERROR "these files read ${needle}: ${bad}")
endif()
message(STATUS "${n} files, none reads ${needle}")
