# kvcache_generate_proto(TARGET ROOT PROTO...): a static library of the
# C++ and gRPC code generated from PROTO files (paths relative to ROOT).
function(kvcache_generate_proto target root)
  set(gen_dir ${CMAKE_CURRENT_BINARY_DIR})
  get_target_property(grpc_plugin gRPC::grpc_cpp_plugin LOCATION)
  set(sources)
  foreach(proto ${ARGN})
    string(REGEX REPLACE "\\.proto$" "" base ${proto})
    set(outs ${gen_dir}/${base}.pb.cc ${gen_dir}/${base}.pb.h
             ${gen_dir}/${base}.grpc.pb.cc ${gen_dir}/${base}.grpc.pb.h)
    add_custom_command(
      OUTPUT ${outs}
      COMMAND protobuf::protoc --proto_path=${root}
        --cpp_out=${gen_dir} --grpc_out=${gen_dir}
        --plugin=protoc-gen-grpc=${grpc_plugin} ${root}/${proto}
      DEPENDS ${root}/${proto} protobuf::protoc gRPC::grpc_cpp_plugin
      COMMENT "protoc ${proto}")
    list(APPEND sources ${outs})
  endforeach()
  add_library(${target} STATIC ${sources})
  target_include_directories(${target} PUBLIC ${gen_dir})
  target_link_libraries(${target} PUBLIC protobuf::libprotobuf gRPC::grpc++)
endfunction()
