# rewrite.cmake — the CUDA emulation's one preprocessing step (docs/cuda-emulation.md): a .cu
# file's launches `name<<<config>>>(args)` become `KVT_EMU_LAUNCH(name)(config)(args)`, in place
# (same lines, so diagnostics and __LINE__ name the source's), which a host C++ compiler reads
# with kernels/cuda/emu/cuda_runtime.h. Nothing else changes. A launch of another shape (a
# template-id before `<<<`, a `>>>` not followed by the arguments) leaves the counts unequal and
# stops the build, naming the file.
#   cmake -DIN=cu_backend.cu -DOUT=cu_backend.emu.cpp -P rewrite.cmake
file(READ "${IN}" src)
string(REGEX MATCHALL "<<<" opens "${src}")
string(REGEX MATCHALL ">>>" closes "${src}")
string(REGEX REPLACE "([A-Za-z_][A-Za-z0-9_]*)[ \t]*<<<" "KVT_EMU_LAUNCH(\\1)(" src "${src}")
string(REGEX REPLACE ">>>([ \t\r\n]*)\\(" ")\\1(" src "${src}")
string(REGEX MATCHALL "<<<|>>>" left "${src}")
list(LENGTH opens n_open)
list(LENGTH closes n_close)
list(LENGTH left n_left)
if(NOT n_open EQUAL n_close OR n_left GREATER 0)
  message(FATAL_ERROR "${IN}: a kernel launch this emulation cannot rewrite (${n_open} '<<<', "
                      "${n_close} '>>>', ${n_left} left after the rewrite): write it as "
                      "name<<<config>>>(args) with a plain kernel name")
endif()
file(WRITE "${OUT}.tmp" "#line 1 \"${IN}\"\n${src}")
file(COPY_FILE "${OUT}.tmp" "${OUT}" ONLY_IF_DIFFERENT)
file(REMOVE "${OUT}.tmp")
