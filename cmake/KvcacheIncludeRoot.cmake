# kvcache_include_root(<target> <PUBLIC|PRIVATE> <folder>)
#
# Gives <target> an include directory that holds one entry: <folder>, a link
# to the source folder of that name. Code includes a project header as
# "<folder>/x.h"; a target that neither is nor links the target exporting
# that folder cannot find it, so an include against the layering of
# docs/architecture.md fails to compile (tests/layering_test.py checks the
# same arrows file by file, including those within one link).
function(kvcache_include_root target scope folder)
  set(root ${PROJECT_BINARY_DIR}/include_roots/${folder})
  if(NOT EXISTS ${root}/${folder})
    file(MAKE_DIRECTORY ${root})
    file(CREATE_LINK ${PROJECT_SOURCE_DIR}/${folder} ${root}/${folder}
      SYMBOLIC)
  endif()
  target_include_directories(${target} ${scope} $<BUILD_INTERFACE:${root}>)
endfunction()
